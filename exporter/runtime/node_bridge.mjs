// The Node side of exporter/runtime/node.py: an artifact's graphs in onnxruntime-web (its WASM backend) or
// onnxruntime-node, and greedy generation in transformers.js, served over stdin/stdout so that one Node process
// answers every call of a verification.
//
// Usage: node node_bridge.mjs PACKAGES_FOLDER, where PACKAGES_FOLDER holds the node_modules that
// install_node_packages() fills. Each message, either way, is a frame (ort_tensors.mjs). A reply's header holds
// "error" (one line) instead when the request failed; the process then serves the next request.
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

import { answer, runGraph, tensorBytes } from "./ort_tensors.mjs";

// stdout carries the frames: whatever a library logs goes to stderr.
console.log = console.info = console.debug = console.error;

const packages = createRequire(join(process.argv[2], "package.json"));

async function load(name) {
  // Resolved from the packages folder, not from this file's: the packages are installed apart from the package.
  return await import(pathToFileURL(packages.resolve(name)).href);
}

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

function run(header, tensors) {
  return runGraph(ort, sessions, header, tensors);
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
  const sizes = specs.map(tensorBytes);
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

process.stdin.on("data", (chunk) => {
  chunks.push(chunk);
  buffered += chunk.length;
  for (let message = take(); message; message = take()) {
    const [header, tensors] = message;
    // one request at a time, in order
    queue = queue.then(async () => process.stdout.write(Buffer.concat(await answer(OPS, header, tensors))));
  }
});
// The end of the input ends the process once the requests before it are answered: nothing else is left to do, and
// the runtimes' teardown would only delay the exit.
process.stdin.on("end", () => queue.then(() => process.exit(0)));
