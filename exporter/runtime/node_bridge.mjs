// The Node side of exporter/runtime/node.py: an artifact's graphs in onnxruntime-web (its WASM backend) or
// onnxruntime-node, and greedy generation in transformers.js, served over stdin/stdout so that one Node process
// answers every call of a verification.
//
// Usage: node node_bridge.mjs PACKAGES_FOLDER, where PACKAGES_FOLDER holds the node_modules that
// install_node_packages() fills. Each message, either way, is a frame: a 4-byte little-endian length, that many
// bytes of JSON (the header), then the bytes of the tensors the header lists, in its order, each as
// {name, dtype, shape} with numpy's dtype names and C order. A reply's header holds "error" (one line) instead
// when the request failed; the process then serves the next request.
//
// Requests:
//   {op: "load", runtime: "onnxruntime-web" | "onnxruntime-node", folder, graphs: [file...], weights, threads}
//       (weights: the external weights file the graphs name, or null)
//       -> {}
//   {op: "run", graph: file, outputs: [name...], tensors} -> {ms, tensors}
//       (ms: the milliseconds session.run took, without the frames' transfer and parsing)
//   {op: "generate", folder, model_file, dtype, prompt: [id...], max_new_tokens}
//       -> {ids: [id...]} (the prompt, then the new ids)

import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { basename, dirname, join } from "node:path";
import { pathToFileURL } from "node:url";

// stdout carries the frames: whatever a library logs goes to stderr.
console.log = console.info = console.debug = console.error;

const packages = createRequire(join(process.argv[2], "package.json"));

async function load(name) {
  // Resolved from the packages folder, not from this file's: the packages are installed apart from the package.
  return await import(pathToFileURL(packages.resolve(name)).href);
}

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

let ort = null; // the loaded runtime's module
const sessions = new Map(); // graph file -> InferenceSession

async function loadGraphs({ runtime, folder, graphs, weights, threads }) {
  if (runtime !== "onnxruntime-web" && runtime !== "onnxruntime-node") {
    throw new Error(`unknown runtime ${runtime}`);
  }
  ort = await load(runtime);
  sessions.clear();
  const options = { graphOptimizationLevel: "all", intraOpNumThreads: threads };
  if (runtime === "onnxruntime-web") {
    ort.env.wasm.numThreads = threads;
    // onnxruntime-web reads no file by itself: the graph and its external weights are given as bytes, the weights
    // under the name the graph's tensors locate them by (without it: "Module.MountedFiles is not available").
    const externalData = weights ? [{ path: weights, data: readFileSync(join(folder, weights)) }] : [];
    for (const file of graphs) {
      const model = readFileSync(join(folder, file));
      sessions.set(file, await ort.InferenceSession.create(model, { ...options, executionProviders: ["wasm"], externalData }));
    }
  } else {
    for (const file of graphs) {
      sessions.set(file, await ort.InferenceSession.create(join(folder, file), { ...options, executionProviders: ["cpu"] }));
    }
  }
  return {};
}

async function run({ graph, outputs }, tensors) {
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
  const ms = performance.now() - begin;
  return {
    ms,
    tensors: outputs.map((name) => {
      const tensor = results[name];
      const data = tensor.type === "bool" ? Uint8Array.from(tensor.data, Number) : tensor.data;
      return {
        name,
        dtype: NUMPY[tensor.type],
        shape: tensor.dims.map(Number),
        bytes: Buffer.from(data.buffer, data.byteOffset, data.byteLength),
      };
    }),
  };
}

async function generate({ folder, model_file, dtype, prompt, max_new_tokens }) {
  const transformers = await load("@huggingface/transformers");
  const { env, AutoModelForCausalLM, Tensor } = transformers;
  env.allowRemoteModels = false; // the folder as it is, or an error: never a download
  env.localModelPath = dirname(folder);
  const model = await AutoModelForCausalLM.from_pretrained(basename(folder), {
    local_files_only: true,
    subfolder: "",
    model_file_name: model_file,
    dtype,
    device: "cpu",
  });
  try {
    const ids = new Tensor("int64", BigInt64Array.from(prompt, BigInt), [1, prompt.length]);
    const mask = new Tensor("int64", new BigInt64Array(prompt.length).fill(1n), [1, prompt.length]);
    const out = await model.generate({ input_ids: ids, attention_mask: mask, max_new_tokens, do_sample: false });
    return { ids: Array.from(out.data, Number) };
  } finally {
    await model.dispose();
  }
}

const OPS = { load: loadGraphs, run, generate };

function frame(header, tensors = []) {
  const json = Buffer.from(JSON.stringify({ ...header, tensors: tensors.map(({ bytes, ...spec }) => spec) }));
  const length = Buffer.alloc(4);
  length.writeUInt32LE(json.length);
  return Buffer.concat([length, json, ...tensors.map((t) => t.bytes)]);
}

const ITEMSIZE = { float32: 4, float16: 2, float64: 8, int64: 8, int32: 4, int8: 1, uint8: 1, bool: 1 };

// Frames arrive in chunks, kept until a whole frame is there and joined only then: joining at every chunk would copy
// a large frame once per chunk.
let chunks = [];
let buffered = 0; // bytes in chunks
let needed = 4; // bytes the next frame needs, as far as known
let queue = Promise.resolve();

function take() {
  if (buffered < needed) return null;
  const pending = chunks.length === 1 ? chunks[0] : Buffer.concat(chunks);
  chunks = [pending];
  const size = pending.readUInt32LE(0);
  if (pending.length < 4 + size) {
    needed = 4 + size;
    return null;
  }
  const header = JSON.parse(pending.subarray(4, 4 + size));
  const specs = header.tensors ?? [];
  const sizes = specs.map((spec) => spec.shape.reduce((a, b) => a * b, 1) * ITEMSIZE[spec.dtype]);
  const end = sizes.reduce((a, b) => a + b, 4 + size);
  if (pending.length < end) {
    needed = end;
    return null;
  }
  let offset = 4 + size;
  const tensors = specs.map((spec, i) => {
    offset += sizes[i];
    return { ...spec, bytes: pending.subarray(offset - sizes[i], offset) };
  });
  chunks = [pending.subarray(end)];
  buffered = pending.length - end;
  needed = 4;
  return [header, tensors];
}

async function answer(header, tensors) {
  try {
    const op = OPS[header.op];
    if (!op) throw new Error(`unknown op ${header.op}`);
    const { tensors: out = [], ...reply } = await op(header, tensors);
    process.stdout.write(frame(reply, out));
  } catch (error) {
    const line = String(error?.message ?? error).split("\n").find((l) => l.trim()) ?? "unknown error";
    process.stdout.write(frame({ error: line.trim() }));
  }
}

process.stdin.on("data", (chunk) => {
  chunks.push(chunk);
  buffered += chunk.length;
  for (let message = take(); message; message = take()) {
    const [header, tensors] = message;
    queue = queue.then(() => answer(header, tensors)); // one request at a time, in order
  }
});
// The end of the input ends the process once the requests before it are answered: nothing else is left to do, and
// the runtimes' teardown would only delay the exit.
process.stdin.on("end", () => queue.then(() => process.exit(0)));
