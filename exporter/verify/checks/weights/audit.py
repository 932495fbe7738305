"""Each graph's initializers held to the PyTorch model's parameters and buffers (`model.named_parameters()`,
`model.named_buffers()`, tied ones once under every name), and to its computed tables
(exporter.verify.checks.weights.tensors says how those match):

- by content, bit for bit, up to the export's own cast: the export casts the model to the artifact's dtype
  (exporter/export/tracing.py), so a weight holds `t.to(dtype)`; where the model multiplies a float16 weight into
  a float32 product (minimind-3's RMSNorm scales in float32), the exporter folds that Cast into a float32
  initializer, `t.to(float16).to(float32)`. Both casts round to nearest even in torch as in the export, and the
  upcast is exact, so a correct initializer equals its parameter exactly: any difference at all is another
  weight, and no tolerance is needed or allowed;
- up to transposition: a Linear weight (out, in) is read by MatMul as (in, out), a transposed copy the exporter
  folds; by Gemm(transB) as it is;
- in its place: each node reading an initializer lies, by torch.onnx's scope metadata, in the module that owns
  the parameter it holds (or in a module enclosing it, which may read its child's weight directly). q_norm's
  weight in k_norm's place, or two layers' norms swapped, match by content and fail here.

A quantized artifact's blocks are held to their parameters as exporter.verify.checks.weights.quantized says.

Not audited, because they are no weights:
- integer and boolean initializers other than a quantized embedding's row-id table: the graph's shapes, axes,
  indices and integer fill values, which the output checks exercise on every call;
- floating initializers of one element: the exporter's scalars (norm epsilons, the exponent 2, the attention
  scale, the mask's fills -inf and -1e9, 0 and 1, YaRN's attention factor). A reference tensor of one element is
  not held to being carried either: the exporter may fold a scalar parameter into such a constant.

The audit fails on an initializer that matches no reference tensor, one that differs from the parameter its
readers' module owns (named, with how many elements differ and by how much), one that holds a parameter in
another's place, and a parameter (of more than one element) that no initializer of the graph carries. Buffers
are matched where carried but need not be: a model may keep buffers (position ids, masks) its forward recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from exporter.artifact.contract import GraphContract
from exporter.artifact.folder import Artifact
from exporter.artifact.quantization import QUANTIZED_OPS, held_inputs, smoothing_divisors, zero_point_fractions
from exporter.artifact.scopes import module_of
from exporter.verify.checks.weights.quantized import (
    audit_blocks,
    audit_blocks_sum,
    audit_row_ids,
    audit_scheme,
    row_id_tables,
)
from exporter.verify.checks.weights.results import GraphAudit, WeightAudit, WeightFinding
from exporter.verify.checks.weights.tensors import (
    ReferenceIndex,
    ReferenceTensor,
    WeightsFile,
    forms,
    read_initializer,
    reference_tensors,
    table_hits,
    tensor_digest,
)
from exporter.verify.diagnosis.probe import FLOAT_TYPES


@dataclass
class _Initializer:
    name: str
    array: np.ndarray | None  # None: unreadable (see problem)
    digest: bytes  # of the array's bytes
    readers: set[str]  # the modules of the nodes reading it, where the graph records them
    problem: str = ""


def _readers(graph: onnx.GraphProto) -> dict[str, set[str]]:
    """For each value name, the modules of the nodes reading it (subgraphs included); a node without scope
    metadata adds nothing."""
    readers: dict[str, set[str]] = {}

    def walk(g: onnx.GraphProto):
        for node in g.node:
            module = module_of(node)
            for name in node.input:
                entry = readers.setdefault(name, set())
                if module is not None:
                    entry.add(module)
            for attribute in node.attribute:
                for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                    walk(sub)

    walk(graph)
    return readers


def _inside(inner: str, outer: str) -> bool:
    """Module `inner` is `outer` or lies within it ("" is the model itself, which holds every module)."""
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def _within(reader: str, owner: str) -> bool:
    """A node scoped to `reader` may read a weight of `owner`: the same module, one inside it (handed the weight),
    or one enclosing it (a parent reading its child's weight directly)."""
    return _inside(reader, owner) or _inside(owner, reader)


def _placed(readers: set[str], owners: set[str] | None, any_reader: bool = False) -> bool:
    """Every reader (or, with any_reader, one) may read a weight of one of `owners`; None (a computed table) and
    no scoped reader place anything."""
    if owners is None or not readers:
        return True
    found = [any(_within(r, o) for o in owners) for r in readers]
    return any(found) if any_reader else all(found)


def _owners(references) -> set[str] | None:
    """The modules holding any of `references`; None when one is a computed table."""
    owners: set[str] = set()
    for reference in references:
        if reference.owners is None:
            return None
        owners |= reference.owners
    return owners


def _difference(array: np.ndarray, expected: np.ndarray) -> tuple[int, str]:
    """How many elements differ, and the largest difference, where, in words."""
    actual, wanted = array.astype(np.float64), expected.astype(np.float64)
    differs = actual != wanted
    count = int(differs.sum())
    if not count:
        return 0, ""
    diff = np.where(differs, np.abs(actual - wanted), 0)
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    ratio = actual[at] / wanted[at] if wanted[at] != 0 else float("inf")
    index = ", ".join(str(int(i)) for i in at)
    return count, (
        f"{count} of {array.size} elements differ, the largest by {diff[at]:.3g} at [{index}] "
        f"({actual[at]:.6g} for {wanted[at]:.6g}, × {ratio:.4g})"
    )


def _closest(
    array: np.ndarray, candidates: list[ReferenceTensor], export_dtype
) -> tuple[ReferenceTensor, np.ndarray, int] | None:
    """The candidate (and the form of it) that `array` differs from in the fewest elements."""
    best = None
    wanted = {(array.dtype.name, tuple(array.shape))}
    for reference in candidates:
        for form, _ in forms(reference, export_dtype, wanted):
            count = int((form.astype(np.float64) != array.astype(np.float64)).sum())
            if best is None or count < best[2]:
                best = (reference, form, count)
    return best


def audit_graph(
    artifact: Artifact, contract: GraphContract, index: ReferenceIndex, weights: WeightsFile | None = None
) -> GraphAudit:
    """One graph's initializers against the reference tensors of `index` (see the module's docstring for the
    rules)."""
    graph = artifact.graph(contract).graph
    readers = _readers(graph)
    weights = weights or WeightsFile(artifact)
    references, export_dtype = index.references, index.export_dtype
    scalars = integers = 0
    audited: list[_Initializer] = []
    blocks = [node for node in graph.node if node.op_type in QUANTIZED_OPS]
    fractions, divisors = zero_point_fractions(graph), smoothing_divisors(graph)
    held_in_blocks = {name for node in blocks for name in held_inputs(node, fractions, divisors)}
    for tensor in graph.initializer:
        if tensor.name in held_in_blocks:
            continue
        if tensor.data_type not in FLOAT_TYPES:
            integers += 1
            continue
        if int(np.prod(tensor.dims, dtype=np.int64)) <= 1:
            scalars += 1
            continue
        array, problem = read_initializer(artifact, tensor, weights)
        digest = b""
        if array is not None:
            where = tuple((e.key, e.value) for e in tensor.external_data) + (tensor.data_type, tuple(tensor.dims))
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                digest = tensor_digest(array)
            elif where in weights.digests:
                digest = weights.digests[where]
            else:
                digest = weights.digests[where] = tensor_digest(array)
        audited.append(_Initializer(tensor.name, array, digest, readers.get(tensor.name, set()), problem))

    file = contract.file
    findings: list[WeightFinding] = []
    carried: set[int] = set()
    named: set[int] = set()  # references a finding names already
    matched = transposed = upcast = constants = 0
    for init in audited:
        if init.array is None:
            findings.append(WeightFinding(file, "unreadable", "", init.name, f"initializer {init.name} {init.problem}"))
            continue
        hits = index.hits(init.array, init.digest) or table_hits(init.array, references, export_dtype)
        if hits and _placed(init.readers, _owners(ref for ref, _ in hits)):
            matched += 1
            reference, how = hits[0]
            transposed += how.startswith("transposed")
            upcast += how.endswith("upcast")
            constants += reference.kind == "constant"
            # Equal tensors are stored once (the exporter merges equal initializers): each is carried where read.
            carried.update(id(ref) for ref, _ in hits if _placed(init.readers, ref.owners, any_reader=True))
            continue
        findings.append(_finding(file, init, hits, references, export_dtype, named))
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    quantized = 0
    for node in blocks:
        found = audit_blocks(artifact, node, initializers, weights, index, carried, named, file, fractions, divisors)
        quantized += found is None
        findings += [found] if found is not None else []
        found = audit_scheme(artifact.manifest, node, file, initializers, fractions, divisors)
        findings += [found] if found is not None else []
    sums = {f.blocks_sum: node for node in blocks if node.name in fractions for f in [fractions[node.name]]}
    for name, node in sums.items():
        found = audit_blocks_sum(artifact, node, name, initializers, weights, file)
        findings += [found] if found is not None else []
    row_ids = row_id_tables(graph, initializers)
    for node, name in row_ids:
        found = audit_row_ids(artifact, node, name, initializers, weights, file)
        findings += [found] if found is not None else []
    for reference in references:
        if reference.required and id(reference) not in carried and id(reference) not in named:
            findings.append(
                WeightFinding(
                    file,
                    "missing",
                    reference.names[0],
                    "",
                    f"{reference.name} is carried by no initializer of {file}",
                )
            )
    required = [r for r in references if r.required]
    return GraphAudit(
        graph=file,
        weights=len(audited),
        matched=matched,
        transposed=transposed,
        upcast=upcast,
        constants=constants,
        scalars=scalars,
        integers=integers,
        parameters=len(required),
        carried=sum(id(r) in carried for r in required),
        findings=tuple(findings),
        quantized=quantized,
        tables=len(row_ids),
        block_sums=len(sums),
    )


def _finding(file: str, init: _Initializer, hits: list, references: list, export_dtype, named: set) -> WeightFinding:
    """Why an initializer matches no reference tensor in its place, naming the parameter due there."""
    array = init.array
    shapes = {tuple(array.shape), tuple(array.shape[::-1])} if array.ndim == 2 else {tuple(array.shape)}
    fitting = [r for r in references if tuple(r.tensor.shape) in shapes]
    # The parameter due where it is read: one its readers' own module holds, else one they may read (_within).
    exact = [r for r in fitting if r.owners and r.owners & init.readers]
    due = exact or [r for r in fitting if r.owners and init.readers and _placed(init.readers, r.owners)]
    where = f" (read in {', '.join(sorted(init.readers)) or 'no scoped node'})"
    if hits:  # another tensor's values, read where it does not belong
        held = ", ".join(ref.name for ref, _ in hits)
        closest = _closest(array, due, export_dtype) if due else None
        if closest is not None:
            named.add(id(closest[0]))
            named.update(id(ref) for ref, _ in hits)
            return WeightFinding(
                file,
                "misplaced",
                closest[0].names[0],
                init.name,
                f"{closest[0].name}: initializer {init.name}{where} holds {held} instead",
            )
        named.update(id(ref) for ref, _ in hits)
        return WeightFinding(
            file,
            "misplaced",
            hits[0][0].names[0],
            init.name,
            f"{held}: initializer {init.name} holds it{where}, outside its module",
        )
    closest = _closest(array, due, export_dtype) if due else None
    if closest is None:
        candidate = _closest(array, fitting, export_dtype)
        # Only a tensor it mostly equals is named: otherwise the initializer is no parameter at all.
        if candidate is not None and candidate[2] <= array.size // 2:
            closest = candidate
    if closest is None:
        return WeightFinding(
            file,
            "unmatched",
            "",
            init.name,
            f"initializer {init.name} {list(array.shape)} {array.dtype}{where} matches no parameter, buffer or "
            "computed table of the reference",
        )
    reference, form, _ = closest
    named.add(id(reference))
    _, how = _difference(array, form)
    return WeightFinding(
        file,
        "differs",
        reference.names[0],
        init.name,
        f"{reference.name} differs in initializer {init.name}{where}: {how}",
    )


def audit_weights(artifact: Artifact, model) -> WeightAudit:
    """Both graphs' initializers against `model`'s parameters, buffers and exported_constants().

    Args:
        artifact: the opened artifact (its hashes checked when it was opened).
        model: the PyTorch reference (torch.nn.Module) the artifact was exported from, in any dtype: its tensors
            are cast to the artifact's as the export cast them.

    Returns:
        The WeightAudit: per graph, what matched and every finding, each naming its parameter.
    """
    import torch

    from reference.layers import TORCH_DTYPES

    manifest = artifact.manifest
    index, weights = ReferenceIndex(reference_tensors(model), TORCH_DTYPES[manifest.dtype]), WeightsFile(artifact)
    with torch.no_grad():
        return WeightAudit(
            tuple(audit_graph(artifact, contract, index, weights) for contract in (manifest.prefill, manifest.decode))
        )
