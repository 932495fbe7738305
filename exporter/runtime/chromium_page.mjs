// The page side of exporter/runtime/chromium.py: an artifact's graphs in onnxruntime-web's WASM backend, in headless
// Chromium. The local server that serves this page serves the artifact's files under /artifact/ and onnxruntime-web's
// dist/ under /ort/; the page asks it for each request (GET /next: a frame, ort_tensors.mjs; 202 while none came,
// 204 once the runner closed) and posts its reply (POST /reply: a frame, whose header holds "error" (one line)
// instead when the request failed).
//
// Requests, as node_bridge.mjs takes them:
//   {op: "load", graphs: [file...], weights, threads} (weights: the external weights file the graphs name, or null)
//       -> {}
//   {op: "run", graph: file, outputs: [name...], tensors} -> {tensors}

import { answer, runGraph, tensorBytes } from "./ort_tensors.mjs";

let ort = null; // onnxruntime-web's module, imported by the first load
const sessions = new Map(); // graph file -> InferenceSession

async function loadGraphs({ graphs, weights, threads }) {
  ort = await import("/ort/ort.wasm.min.mjs");
  ort.env.wasm.wasmPaths = "/ort/";
  ort.env.wasm.numThreads = threads;
  sessions.clear();
  // A browser's onnxruntime-web fetches the graph and its external weights by URL, the weights under the name the
  // graph's tensors locate them by.
  const externalData = weights ? [{ path: weights, data: `/artifact/${weights}` }] : [];
  const options = { graphOptimizationLevel: "all", intraOpNumThreads: threads, executionProviders: ["wasm"] };
  for (const file of graphs) {
    sessions.set(file, await ort.InferenceSession.create(`/artifact/${file}`, { ...options, externalData }));
  }
  return {};
}

const OPS = { load: loadGraphs, run: (header, tensors) => runGraph(ort, sessions, header, tensors) };

function parse(bytes) {
  const size = new DataView(bytes.buffer, bytes.byteOffset, 4).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(4, 4 + size)));
  let offset = 4 + size;
  const tensors = (header.tensors ?? []).map((spec) => {
    offset += tensorBytes(spec);
    return { ...spec, bytes: bytes.subarray(offset - tensorBytes(spec), offset) };
  });
  return [header, tensors];
}

for (;;) {
  const response = await fetch("/next", { cache: "no-store" });
  if (response.status === 204) break;
  if (response.status !== 200) continue; // none yet: ask again
  const [header, tensors] = parse(new Uint8Array(await response.arrayBuffer()));
  await fetch("/reply", { method: "POST", body: new Blob(await answer(OPS, header, tensors)) });
}
