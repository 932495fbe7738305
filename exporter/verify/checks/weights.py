"""The weight audit: every initializer of both graphs matched to the reference tensor it came from.

Output comparisons cannot see a weight fault smaller than their tolerance: in a float16 export, one channel of a
norm × 1.01 or one weight × 1.05 moves no output beyond float16's own rounding. The weights themselves can be
compared exactly, without running anything, so each graph's initializers are held to the PyTorch model's
parameters and buffers (`model.named_parameters()`, `model.named_buffers()`, tied ones once under every name):

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

An initializer may also hold a table that the reference computes from its config alone and the exporter folds
into the graph: those the model lists in `exported_constants()` (minimind's rotary inverse frequencies), as
computed (the forward computes them in float32 whatever the model's dtype) or cast to the artifact's dtype,
wherever they are read. A table is not copied but computed again by the exporter's constant folding, whose
elementary functions are not torch's. Each library computes `pow` within an ulp of the exact value (a relative
error of at most ε = 2^-23, float32's machine epsilon), so the two copies of `base ** e` may differ by 2ε; the
reciprocal keeps that relative difference and rounds each side once more (ε/2 each), and YaRN's ramp multiplies
both by the same factor (its basic operations give identical results on identical inputs), rounding each side once
more: the copies lie at most 4ε apart, relative (TABLE_RTOL). Held in float16, two float32 values that close round
to float16 values at most one float16 ulp apart. A wrong base, dimension or scaling moves the frequencies by far
more.

In a quantized artifact (manifest `quantization`), each MatMulNBits node holds a projection, and a
GatherBlockQuantized node the token embedding, as blocks of `bits`-bit integers, a scale and a zero point per block:
it cannot equal its parameter bit for bit. Each node lies in the module whose Linear (or embedding) it replaced (the
export gives it the MatMul's scope, exporter/export/quantize.py), and is held to that module's parameter as
onnxruntime's quantizer makes blocks of it (exporter/verify/checks/blocks.py derives each bound): its scales and zero
points equal the quantizer's bit for bit, and each dequantized weight, (q - zero_point) * scale, lies within half a
step of the parameter, plus rounding. Another layer's blocks in its place, a scale × 1.05 or rounded to another
format, a zero point off by one, fail; the finding names the parameter the blocks hold instead where they are
another's. Blocks of more bits than recorded would pass that test, so each node's bits and block size (and whether
it has zero points) are also held to the manifest's scheme (the lm_head to its `lm_head` option, the embedding to its
`embedding` option). The ids reach the quantized embedding through a Gather of a table of row numbers (it fails on
ids outside the table, as the float graph's Gather does): that integer table must hold 0 .. rows-1, or it would give
one token another's row.

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

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exporter.artifact.contract import GraphContract
from exporter.artifact.folder import Artifact
from exporter.artifact.quantization import GATHER_OP, QUANTIZED_OPS, block_inputs
from exporter.artifact.scopes import module_of
from exporter.verify.checks.blocks import check_blocks, dequantize_blocks, layout
from exporter.verify.diagnosis.probe import FLOAT_TYPES

# How many findings of one graph the report lists in full; the rest are counted.
SHOWN_FINDINGS = 8
# A computed table's elements match within this relative difference of the reference's, and held in float16 within
# one float16 ulp more (the module's docstring derives it).
TABLE_RTOL = 4 * float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class WeightFinding:
    """One way a graph's weights are not the reference's.

    problem: "differs" (the initializer read where `parameter` belongs holds other values), "misplaced" (it holds
    another reference tensor, named in the detail), "unmatched" (it matches no reference tensor), "missing" (no
    initializer carries `parameter`), "unreadable" (its data cannot be read from the artifact), "scheme" (a quantized
    matrix's bits or block size are not those the manifest's quantization records), "unplaced" (a quantized matrix
    whose node lies in no module).
    """

    graph: str
    problem: str
    parameter: str  # the reference tensor concerned; "" when none can be named
    initializer: str  # the graph's initializer; "" for a missing parameter
    detail: str
    # quantized blocks: the worst weight's distance from its parameter, in multiples of half a step plus rounding;
    # None where the comparison is exact (a float initializer, a scale, a table of ids)
    multiple: float | None = None

    def describe(self) -> str:
        return f"{self.graph}: {self.detail}"

    def to_dict(self) -> dict:
        return {
            "graph": self.graph,
            "problem": self.problem,
            "parameter": self.parameter,
            "initializer": self.initializer,
            "detail": self.detail,
            "multiple": self.multiple,
        }


@dataclass(frozen=True, kw_only=True)
class GraphAudit:
    """One graph's initializers against the reference."""

    graph: str
    weights: int  # floating initializers of more than one element: each audited
    matched: int  # of those, the ones equal to a reference tensor in its place
    transposed: int  # of the matched, those holding their tensor transposed
    upcast: int  # of the matched, those holding a float16 value in float32 (a folded Cast)
    constants: int  # of the matched, those holding a table of exported_constants()
    scalars: int  # floating initializers of one element: not audited
    integers: int  # integer and boolean initializers: not audited
    parameters: int  # reference tensors this graph must carry
    carried: int  # of those, the ones an initializer carries
    findings: tuple[WeightFinding, ...] = ()
    quantized: int = 0  # MatMulNBits and GatherBlockQuantized matrices, each its parameter's blocks as quantized
    tables: int = 0  # of the integer initializers, the row-id tables audited (equal to 0 .. rows-1)

    @property
    def passed(self) -> bool:
        return not self.findings

    @property
    def summary(self) -> str:
        """What was matched and what was left out, in one line."""
        return (
            f"{self.matched} of {self.weights} weight initializers equal their reference tensor exactly "
            f"({self.transposed} transposed, {self.upcast} float16 values held in float32, {self.constants} "
            f"computed tables{self._quantized_clause}); {self.carried} of {self.parameters} parameters carried; "
            f"{self.scalars} one-element and {self.integers - self.tables} integer initializers not audited"
        )

    @property
    def _quantized_clause(self) -> str:
        if not self.quantized:
            return ""
        tables = f", {self.tables} row-id tables equal to 0 .. rows-1" if self.tables else ""
        return (
            f"; {self.quantized} quantized matrices the quantizer's blocks of their module's parameter, scales and zero"
            f" points exactly, every weight within half a step{tables}"
        )

    @property
    def detail(self) -> str:
        """The summary, after the findings (the first SHOWN_FINDINGS) when there are any."""
        if not self.findings:
            return self.summary
        shown = "; ".join(f.detail for f in self.findings[:SHOWN_FINDINGS])
        more = len(self.findings) - SHOWN_FINDINGS
        return f"{len(self.findings)} finding(s): {shown}{f'; and {more} more' if more > 0 else ''} ({self.summary})"

    def to_dict(self) -> dict:
        return {
            "graph": self.graph,
            "passed": self.passed,
            "weights": self.weights,
            "matched": self.matched,
            "transposed": self.transposed,
            "upcast": self.upcast,
            "constants": self.constants,
            "scalars": self.scalars,
            "integers": self.integers,
            "parameters": self.parameters,
            "carried": self.carried,
            "quantized": self.quantized,
            "tables": self.tables,
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass(frozen=True)
class WeightAudit:
    """Both graphs' initializers against the PyTorch model's parameters."""

    graphs: tuple[GraphAudit, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return bool(self.graphs) and all(g.passed for g in self.graphs)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def findings(self) -> list[WeightFinding]:
        return [f for g in self.graphs for f in g.findings]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "graphs": [g.to_dict() for g in self.graphs]}


# ----------------------------------------------------------------------------------------- the reference side


@dataclass
class _Reference:
    """A parameter, buffer or computed table of the reference, under all its names."""

    names: list[str]  # the first is the one reported; tied tensors have several
    tensor: object  # torch.Tensor
    kind: str  # "parameter", "buffer" or "constant"

    @property
    def name(self) -> str:
        return self.names[0] + (f" (also {', '.join(self.names[1:])})" if len(self.names) > 1 else "")

    @property
    def owners(self) -> set[str] | None:
        """The modules holding it (None for a computed table, which any module may read)."""
        if self.kind == "constant":
            return None
        return {name.rpartition(".")[0] for name in self.names}

    @property
    def required(self) -> bool:
        return self.kind == "parameter" and self.tensor.numel() > 1


def _references(model) -> list[_Reference]:
    """The model's floating parameters and buffers, each tensor once under every name it has, then its
    exported_constants()."""
    found: dict[int, _Reference] = {}
    for kind, named in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            if tensor is None or not tensor.is_floating_point():
                continue
            if id(tensor) in found:
                found[id(tensor)].names.append(name)
            else:
                found[id(tensor)] = _Reference([name], tensor.detach(), kind)
    constants = getattr(model, "exported_constants", None)
    tables = constants() if callable(constants) else {}
    return [*found.values(), *(_Reference([name], t.detach(), "constant") for name, t in tables.items())]


def _torch_dtype(np_dtype: np.dtype):
    import torch

    return {
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float16): torch.float16,
        np.dtype(np.float64): torch.float64,
    }.get(np.dtype(np_dtype))


def _forms(reference: _Reference, export_dtype, wanted: set[tuple[str, tuple]]) -> Iterator[tuple[np.ndarray, str]]:
    """The arrays an initializer holding `reference` may equal, each with how it came to be: cast to the export's
    dtype (a computed table also as computed), then to the initializer's dtype; as it is, and transposed when
    2-D. Only the (dtype, shape) pairs in `wanted` (those of the graph's initializers) are built."""
    shapes = {tuple(reference.tensor.shape)}
    if reference.tensor.ndim == 2:
        shapes.add(tuple(reference.tensor.shape[::-1]))
    seen = set()
    for dtype_name, shape in wanted:
        if shape not in shapes:
            continue
        target = _torch_dtype(np.dtype(dtype_name))
        if target is None:
            continue
        casts = [(reference.tensor.to(export_dtype), target.itemsize > export_dtype.itemsize)]
        if reference.kind == "constant":
            casts.append((reference.tensor, False))
        for cast, upcast in casts:
            value = cast.to(target)
            for transposed in (False, True) if reference.tensor.ndim == 2 else (False,):
                array = (value.t() if transposed else value).contiguous().cpu().numpy()
                if tuple(array.shape) != shape:
                    continue
                key = (dtype_name, shape, _digest(array))
                if key not in seen:
                    seen.add(key)
                    yield array, ("transposed " if transposed else "") + ("upcast" if upcast else "")


def _table(array: np.ndarray, references: list[_Reference], export_dtype) -> list[tuple[_Reference, str]]:
    """The computed table `array` equals within TABLE_RTOL of each element (and one float16 ulp more when held in
    float16), as a hit; none otherwise."""
    wanted = {(array.dtype.name, tuple(array.shape))}
    for reference in references:
        if reference.kind != "constant":
            continue
        for form, how in _forms(reference, export_dtype, wanted):
            expected = form.astype(np.float64)
            reach = TABLE_RTOL * np.abs(expected)
            if form.dtype.itemsize < 4:
                reach = reach + np.spacing(np.abs(form)).astype(np.float64)
            if np.all(np.abs(array.astype(np.float64) - expected) <= reach):
                return [(reference, how)]
    return []


class _Index:
    """The reference tensors' forms by (dtype, shape, digest), shared by both graphs: the forms of one (dtype,
    shape) are built the first time an initializer of that dtype and shape asks for them."""

    def __init__(self, references: list[_Reference], export_dtype):
        self.references, self.export_dtype = references, export_dtype
        self._built: set[tuple] = set()
        self._forms: dict[tuple, list[tuple[_Reference, str]]] = {}

    def hits(self, array: np.ndarray, digest: bytes) -> list[tuple[_Reference, str]]:
        """The reference tensors `array` (whose digest is given) equals exactly, each with how it came to be."""
        key = (array.dtype.name, tuple(array.shape))
        if key not in self._built:
            self._built.add(key)
            for reference in self.references:
                for form, how in _forms(reference, self.export_dtype, {key}):
                    self._forms.setdefault((*key, _digest(form)), []).append((reference, how))
        return self._forms.get((*key, digest), [])


def _digest(array: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"), digest_size=20).digest()


# ------------------------------------------------------------------------------------------- the graph side


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


def _read(artifact: Artifact, tensor: onnx.TensorProto, weights) -> tuple[np.ndarray | None, str]:
    """The initializer's values: inline from the graph, external from the artifact's weights file (mapped once,
    read only)."""
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor), ""
    info = {entry.key: entry.value for entry in tensor.external_data}
    if info.get("location") != artifact.manifest.weights_file:
        return None, f"points into {info.get('location')!r}, not the weights file {artifact.manifest.weights_file}"
    offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    if length != count * dtype.itemsize or offset < 0 or offset + length > len(weights()):
        return (
            None,
            f"points at bytes {offset}..{offset + length} of the weights file, not a {list(tensor.dims)} {dtype}",
        )
    return weights()[offset : offset + length].view(dtype).reshape(tuple(tensor.dims)), ""


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


# ------------------------------------------------------------------------------------------------ the audit


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
    array: np.ndarray, candidates: list[_Reference], export_dtype
) -> tuple[_Reference, np.ndarray, int] | None:
    """The candidate (and the form of it) that `array` differs from in the fewest elements."""
    best = None
    wanted = {(array.dtype.name, tuple(array.shape))}
    for reference in candidates:
        for form, _ in _forms(reference, export_dtype, wanted):
            count = int((form.astype(np.float64) != array.astype(np.float64)).sum())
            if best is None or count < best[2]:
                best = (reference, form, count)
    return best


class _WeightsFile:
    """The artifact's weights file, mapped read-only at the first external tensor, and the digest of each tensor
    in it: both graphs point at the same bytes, which are hashed once."""

    def __init__(self, artifact: Artifact):
        self.path = artifact.path(artifact.manifest.weights_file)
        self._mapped = None
        self.digests: dict[tuple, bytes] = {}

    def __call__(self) -> np.ndarray:
        if self._mapped is None:
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mapped


def audit_graph(
    artifact: Artifact, contract: GraphContract, index: _Index, weights: _WeightsFile | None = None
) -> GraphAudit:
    """One graph's initializers against the reference tensors of `index` (see the module's docstring for the
    rules)."""
    graph = artifact.graph(contract).graph
    readers = _readers(graph)
    weights = weights or _WeightsFile(artifact)
    references, export_dtype = index.references, index.export_dtype
    scalars = integers = 0
    audited: list[_Initializer] = []
    blocks = [node for node in graph.node if node.op_type in QUANTIZED_OPS]
    held_in_blocks = {name for node in blocks for name in block_inputs(node)}
    for tensor in graph.initializer:
        if tensor.name in held_in_blocks:
            continue
        if tensor.data_type not in FLOAT_TYPES:
            integers += 1
            continue
        if int(np.prod(tensor.dims, dtype=np.int64)) <= 1:
            scalars += 1
            continue
        array, problem = _read(artifact, tensor, weights)
        digest = b""
        if array is not None:
            where = tuple((e.key, e.value) for e in tensor.external_data) + (tensor.data_type, tuple(tensor.dims))
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                digest = _digest(array)
            elif where in weights.digests:
                digest = weights.digests[where]
            else:
                digest = weights.digests[where] = _digest(array)
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
        hits = index.hits(init.array, init.digest) or _table(init.array, references, export_dtype)
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
        found = _audit_blocks(artifact, node, initializers, weights, index, carried, named, file)
        quantized += found is None
        findings += [found] if found is not None else []
        found = _audit_scheme(artifact.manifest, node, file)
        findings += [found] if found is not None else []
    row_ids = _row_ids(graph, initializers)
    for node, name in row_ids:
        found = _audit_row_ids(artifact, node, name, initializers, weights, file)
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
    )


def _audit_scheme(manifest, node: onnx.NodeProto, file: str) -> WeightFinding | None:
    """A quantized node's bits and block size against the scheme the manifest records: the embedding (the
    GatherBlockQuantized node) at the bits its `embedding` option gives, the lm_head (the MatMulNBits matrix of
    vocabulary width) at those of its `lm_head` option, every other matrix at the scheme's; None when they agree.
    Blocks of more bits than recorded still lie within their scales, so only this tells such an artifact from the
    one it claims to be."""
    scheme, held = manifest.quantization, block_inputs(node)[0]
    if scheme is None:
        return WeightFinding(file, "scheme", "", held, f"{node.name} is quantized, but the manifest is float")
    if node.op_type == GATHER_OP:
        role, choice = "the embedding", ("embedding", scheme.embedding)
    elif _attribute(node, "N", 0) == manifest.config.vocab_size:
        role, choice = "the lm_head", ("lm_head", scheme.lm_head)
    else:
        role, choice = "a projection", None
    expected = scheme.bits_for(choice[1]) if choice else scheme.bits
    bits, block = _attribute(node, "bits", 4), _attribute(node, "block_size", 0)
    symmetric = len(block_inputs(node)) < 3  # no zero points
    if symmetric != scheme.symmetric:
        return WeightFinding(
            file,
            "scheme",
            "",
            held,
            f"{node.name}, {role}, holds {'symmetric' if symmetric else 'asymmetric'} blocks, but the manifest records "
            f"{'symmetric' if scheme.symmetric else 'asymmetric'} ones",
        )
    if (bits, block) == (expected, scheme.block_size):
        return None
    asked = f" ({choice[0]} {choice[1]})" if choice else ""
    recorded = f"{expected}-bit blocks of {scheme.block_size}" if expected else "float weights"
    return WeightFinding(
        file,
        "scheme",
        "",
        held,
        f"{node.name}, {role}{asked}, holds {bits}-bit blocks of {block}, but the manifest records {scheme.scheme} "
        f"with {recorded} for it",
    )


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _audit_blocks(artifact, node, initializers, weights, index: _Index, carried: set, named: set, file: str):
    """A quantized node's blocks against the parameter of the module it lies in (its scope), as onnxruntime's
    quantizer makes them (exporter/verify/checks/blocks.py); None when they are (it is then carried), else the
    finding, naming the parameter they hold instead where they are another's."""
    names = block_inputs(node)
    arrays = []
    for name in names:
        array, problem = _read(artifact, initializers[name], weights) if name in initializers else (None, "missing")
        if array is None:
            return WeightFinding(file, "unreadable", "", name, f"initializer {name} of {node.name} {problem}")
        arrays.append(array)
    b, scales, zero_points = (*arrays, None)[:3]
    module = module_of(node)
    if module is None:
        return WeightFinding(
            file,
            "unplaced",
            "",
            names[0],
            f"quantized matrix {names[0]} of {node.name} lies in no module (no scope metadata), so no parameter is "
            "due there; re-export the artifact with this version of the toolkit, which records it",
        )
    shape = layout(node, b)[:2]
    fitting = [r for r in index.references if r.kind == "parameter" and tuple(r.tensor.shape) == shape]
    due = next((r for r in fitting if module in r.owners), None)
    if due is None:
        return WeightFinding(
            file,
            "unmatched",
            "",
            names[0],
            f"quantized matrix {names[0]} {list(shape)} of {node.name} (in {module}) is no parameter of {module} "
            "of that shape",
        )
    checked = check_blocks(node, b, scales, zero_points, _graph_values(due, index.export_dtype))
    if checked.passed:
        carried.add(id(due))
        return None
    named.add(id(due))
    held = next(
        (
            r
            for r in fitting
            if r is not due and check_blocks(node, b, scales, zero_points, _graph_values(r, index.export_dtype)).passed
        ),
        None,
    )
    if held is not None:
        named.add(id(held))
        return WeightFinding(
            file,
            "misplaced",
            due.names[0],
            names[0],
            f"{due.name}: the quantized blocks {names[0]} of {node.name} (in {module}) hold {held.name} instead",
            multiple=checked.worst,
        )
    return WeightFinding(
        file,
        "differs",
        due.names[0],
        names[0],
        f"{due.name} differs in the quantized blocks {names[0]} of {node.name}: {checked.describe()}",
        multiple=checked.worst,
    )


def _graph_values(reference: _Reference, export_dtype) -> np.ndarray:
    """A parameter as the float graph held it before quantization (cast to the export's dtype), as float32."""
    return reference.tensor.to(export_dtype).float().cpu().numpy()


def _row_ids(graph: onnx.GraphProto, initializers: dict) -> list[tuple[onnx.NodeProto, str]]:
    """The row-id tables in front of GatherBlockQuantized nodes (exporter/export/quantize.py): (the node, the
    integer initializer that a Gather reads the ids through)."""
    producers = {out: node for node in graph.node for out in node.output}
    found = []
    for node in graph.node:
        if node.op_type != GATHER_OP:
            continue
        guard = producers.get(node.input[1])
        if guard is not None and guard.op_type == "Gather" and guard.input[0] in initializers:
            found.append((node, guard.input[0]))
    return found


def _audit_row_ids(
    artifact, node: onnx.NodeProto, name: str, initializers: dict, weights, file: str
) -> WeightFinding | None:
    """The row-id table `name` in front of the quantized embedding `node` against what it must be, 0 .. rows-1 (it
    passes each id in the table through unchanged, and fails on the others); None when it is."""
    table, problem = _read(artifact, initializers[name], weights)
    if table is None:
        return WeightFinding(file, "unreadable", "", name, f"row-id table {name} of {node.name} {problem}")
    rows = int(initializers[node.input[0]].dims[0])  # the quantized table's rows
    identity = np.arange(rows)
    if table.shape == (rows,) and np.array_equal(table, identity):
        return None
    if table.shape != (rows,):
        how = f"has shape {list(table.shape)}, not [{rows}]"
    else:
        wrong = np.flatnonzero(table != identity)
        how = f"{wrong.size} of {rows} entries differ, e.g. entry {wrong[0]} holds {table[wrong[0]]}"
    return WeightFinding(
        file,
        "differs",
        "",
        name,
        f"the row-id table {name} in front of the quantized embedding {node.name} must hold 0 .. {rows - 1}: {how}",
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


def dequantized_weights(artifact: Artifact) -> dict[str, np.ndarray]:
    """The weight each quantized node of `artifact`'s prefill graph computes with in float math, by the module it
    lies in ({"model.layers.0.self_attn.q_proj": (out, in) float32}; the embedding's (vocab, hidden)). Both graphs
    hold the same blocks (the invariants check it). A node in no module is left out: the weight audit fails it."""
    graph = artifact.graph(artifact.manifest.prefill).graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    weights = _WeightsFile(artifact)
    found = {}
    for node in graph.node:
        module = module_of(node) if node.op_type in QUANTIZED_OPS else None
        if module is None:
            continue
        arrays = [_read(artifact, initializers[name], weights)[0] for name in block_inputs(node)]
        if any(array is None for array in arrays):
            continue  # unreadable: the weight audit fails it
        found[module] = dequantize_blocks(node, *arrays, *[None] * (3 - len(arrays)))
    return found


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
    index, weights = _Index(_references(model), TORCH_DTYPES[manifest.dtype]), _WeightsFile(artifact)
    with torch.no_grad():
        return WeightAudit(
            tuple(audit_graph(artifact, contract, index, weights) for contract in (manifest.prefill, manifest.decode))
        )
