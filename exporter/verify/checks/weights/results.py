"""The weight audit's results: each finding, each graph's audit and both graphs'; to_dict() is the JSON report's
part."""

from __future__ import annotations

from dataclasses import dataclass, field

# How many findings of one graph the report lists in full; the rest are counted.
SHOWN_FINDINGS = 8


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
    block_sums: int = 0  # the 0/1 matrices that sum each block of an HQQ node's input for its zero points' fractions

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
        tables += f", {self.block_sums} block-sum matrices of 0s and 1s" if self.block_sums else ""
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
            "block_sums": self.block_sums,
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
