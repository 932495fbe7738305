// What node_bridge.mjs (in Node) and chromium_page.mjs (in headless Chromium) share: the frames both read and
// write, numpy tensors turned into the onnxruntime JavaScript API's and back, and a graph run. A frame is a 4-byte
// little-endian length, that many bytes of JSON (the header), then the bytes of the tensors the header lists, in
// its order, each as {name, dtype, shape} with numpy's dtype names and C order.

// numpy's dtype names and the onnxruntime JavaScript API's, with the typed array each takes. float16 travels as
// its bits in a Uint16Array, which every onnxruntime-web and -node version accepts.
const TYPES = {
  float32: ["float32", Float32Array],
  float16: ["float16", Uint16Array],
  float64: ["float64", Float64Array],
  int64: ["int64", BigInt64Array],
  int32: ["int32", Int32Array],
  int8: ["int8", Int8Array],
  uint8: ["uint8", Uint8Array],
  bool: ["bool", Uint8Array],
};
const NUMPY = Object.fromEntries(Object.entries(TYPES).map(([numpy, [ort]]) => [ort, numpy]));

export function tensorBytes(spec) {
  return spec.shape.reduce((a, b) => a * b, 1) * TYPES[spec.dtype][1].BYTES_PER_ELEMENT;
}

// A frame's pieces, in order: its length, its header, each tensor's bytes (uncopied).
export function frameParts(header, tensors = []) {
  const json = new TextEncoder().encode(JSON.stringify({ ...header, tensors: tensors.map(({ bytes, ...spec }) => spec) }));
  const length = new Uint8Array(4);
  new DataView(length.buffer).setUint32(0, json.length, true);
  return [length, json, ...tensors.map((t) => t.bytes)];
}

// The reply to a request of `header.op`, run by ops[op](header, tensors), as frameParts: its result, or an
// "error" of one line, after which the caller serves the next request.
export async function answer(ops, header, tensors) {
  try {
    const op = ops[header.op];
    if (!op) throw new Error(`unknown op ${header.op}`);
    const { tensors: out = [], ...reply } = await op(header, tensors);
    return frameParts(reply, out);
  } catch (error) {
    const line = String(error?.message ?? error).split("\n").find((l) => l.trim()) ?? "unknown error";
    return frameParts({ error: line.trim() });
  }
}

// {graph, outputs} run on `sessions` (graph file -> InferenceSession of the module `ort`): the reply to a "run",
// with `ms`, the milliseconds session.run took.
export async function runGraph(ort, sessions, { graph, outputs }, tensors) {
  const session = sessions.get(graph);
  if (!session) throw new Error(`${graph} is not loaded`);
  const feeds = {};
  for (const { name, dtype, shape, bytes } of tensors) {
    const [type, ArrayType] = TYPES[dtype];
    const copy = new Uint8Array(bytes); // aligned for the typed array, whatever the frame's offset
    feeds[name] = new ort.Tensor(type, new ArrayType(copy.buffer, 0, copy.byteLength / ArrayType.BYTES_PER_ELEMENT), shape);
  }
  const begin = performance.now();
  const results = await session.run(feeds, outputs);
  return {
    ms: performance.now() - begin, // session.run alone, without the frames' way through the pipe
    tensors: outputs.map((name) => {
      const tensor = results[name];
      const data = tensor.type === "bool" ? Uint8Array.from(tensor.data, Number) : tensor.data;
      return {
        name,
        dtype: NUMPY[tensor.type],
        shape: tensor.dims.map(Number),
        bytes: new Uint8Array(data.buffer, data.byteOffset, data.byteLength),
      };
    }),
  };
}
