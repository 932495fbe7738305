"""The stable import path of the verification engine (exporter/verify/), kept for existing callers:
`from exporter.parity import verify_artifact, ParitySettings, Tolerance, compare`."""

from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings
from exporter.verify.metrics import Comparison, Tolerance, aggregate, compare
from exporter.verify.results import VerifyReport
from exporter.verify.tolerances import CPU, PROFILES

# The CPU profile per dtype, as {dtype: {"logits": Tolerance, "kv": ..., "loss": ...}}.
TOLERANCES = {dtype: {kind: profile[kind] for kind in ("logits", "kv", "loss")}
              for (dtype, provider), profile in PROFILES.items() if provider == CPU}

__all__ = ["Comparison", "ParitySettings", "TOLERANCES", "Tolerance", "VerifyReport", "aggregate", "compare",
           "verify_artifact"]
