"""The execution providers this toolkit runs and verifies on: their names, whether CUDA can start here, whether a
provider has the MatMulNBits kernels of a quantized artifact, and the providers list a session is made with."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import onnxruntime as ort

from exporter.errors import ProviderError, first_line
from exporter.runtime.settings import plain_session_options

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
PROVIDER_ALIASES = {"cpu": CPU, "cuda": CUDA}
PARITY_PROVIDERS = (CPU, CUDA)


def provider_name(name: str) -> str:
    """The full name of `cpu`, `cuda`, or of any provider this build has, written short or in any case."""
    if not isinstance(name, str):  # else None, or a list where one name is taken, fails as "no attribute 'lower'"
        raise ProviderError(
            f"a provider is a name such as 'cpu' or 'cuda', got {name!r} ({type(name).__name__}); pass one (`provider`)"
        )
    for full in ort.get_available_providers():
        if name.lower() in (full.lower(), full.lower().removesuffix("executionprovider")):
            return full
    return PROVIDER_ALIASES.get(name.lower(), name)


def check_provider(name: str) -> str:
    """The full provider name, or ProviderError unless it is the CPU or CUDA provider and this build has it.

    Any other provider (onnxruntime's Azure provider, say) would run the graphs on the CPU
    provider behind it, untested and unverified under its own name.
    """
    full = provider_name(name)
    if full not in PARITY_PROVIDERS:
        raise ProviderError(
            f"this toolkit runs and verifies on {' and '.join(PARITY_PROVIDERS)}, not "
            f"{full or 'an empty name'}; pass cpu or cuda (`provider`)"
        )
    if full == CUDA and (unusable := cuda_unusable()) is not None:  # every build has the CPU provider
        raise ProviderError(f"{CUDA} cannot run here: {unusable}")
    return full


def check_quantized_provider(provider: str, manifest) -> None:
    """ProviderError when `provider` (a full name) has no MatMulNBits kernel of the artifact's bits: its session
    would run those nodes on the CPU provider behind it, copying activations back and forth, unverified under the
    provider's name. Nothing for a float artifact, nor on the CPU provider, which has the kernel for 4 and 8 bits."""
    quantization = manifest.quantization
    if quantization is None or provider == CPU:
        return
    bits = {quantization.bits, quantization.bits_for(quantization.lm_head) or quantization.bits}
    bits = sorted(bits | {m.bits for m in quantization.mix if m.bits is not None})
    for reason in filter(None, (matmul_nbits_unusable(provider, b) for b in bits)):
        raise ProviderError(
            f"{provider} cannot run this {quantization.scheme} artifact: {reason}; run it on the CPU (`provider`), "
            "or export it as float32 for this provider"
        )


@functools.cache
def matmul_nbits_unusable(provider: str, bits: int) -> str | None:
    """Why `provider` cannot run a float32 MatMulNBits node of `bits` bits itself, or None: one such node in a session
    that may not fall back to the CPU provider tells."""
    k = n = 32
    blob = k * bits // 8
    node = onnx.helper.make_node(
        "MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=k
    )
    graph = onnx.helper.make_graph(
        [node],
        "matmul_nbits_probe",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])],
        [
            onnx.numpy_helper.from_array(np.zeros((n, 1, blob), np.uint8), "b"),
            onnx.numpy_helper.from_array(np.ones(n, np.float32), "scales"),
        ],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)],
        ir_version=9,
    )
    options = plain_session_options()
    if provider != CPU:  # the provider alone, not the CPU provider behind it (onnxruntime refuses both at once)
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
    except Exception as exc:  # noqa: BLE001 -- any failure to place the node there is the answer
        return f"no {bits}-bit MatMulNBits kernel on {provider} ({first_line(exc, 160)})"
    return None


def cuda_unusable() -> str | None:
    """Why the CUDA provider cannot run here, or None when it can."""
    return _cuda_start_failure(tuple(ort.get_available_providers()))


@functools.cache
def _cuda_start_failure(available: tuple[str, ...]) -> str | None:
    if CUDA not in available:
        return "not available in this onnxruntime build (install onnxruntime-gpu on a machine with a CUDA GPU)"
    # A build lists its providers whether or not a GPU, CUDA and cuDNN are there to start them, and a
    # session whose provider fails to start falls back to the CPU: one Identity node tells.
    identity = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "cuda_probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = onnx.helper.make_model(identity, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    options = plain_session_options()  # once the shared thread pool exists, a session with its own pool fails
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the build's own "not in available provider names"
            started = ort.InferenceSession(
                model.SerializeToString(), options, providers=[CUDA], enable_fallback=0
            ).get_providers()
    except Exception as exc:  # noqa: BLE001 -- any failure to start it is the answer, never a crash
        return f"could not start ({first_line(exc, 200)}); check the GPU, CUDA and cuDNN installation"
    if CUDA not in started:
        return "could not start (onnxruntime fell back to the CPU); check the GPU, CUDA and cuDNN installation"
    return None


def check_parity_providers(names) -> list[str]:
    """Providers to verify on, as full names without repeats, each checked; a str names one provider."""
    if isinstance(names, str):  # iterated, "cpu" would be the providers "c", "p" and "u"
        names = [names]
    if not isinstance(names, (list, tuple)):  # else 5 fails as "'int' object is not iterable"
        raise ProviderError(
            f"providers must be a provider name or a list of them, got {names!r:.80}; pass e.g. "
            "['cpu'], or None for every available one (`providers`)"
        )
    return list(dict.fromkeys(check_provider(name) for name in names))


def session_providers(full_name: str) -> list:
    """The providers list of a session on `full_name`: the CPU provider runs the ops another provider lacks.

    Every session is made with enable_fallback=0: onnxruntime's Python binding otherwise answers a failure to
    create or run one (any ValueError or RuntimeError, e.g. a message that is no UTF-8) by printing a banner to
    stdout, into --json's document, and retrying on the CPU alone: a CUDA verification would run on the CPU.

    CUDA runs with TF32 off: onnxruntime's CUDA provider turns it on by default, which rounds a float32
    MatMul's inputs to 11 significant bits, so a float32 artifact would neither compute in float32 nor
    match what its verification promises (float32 tolerances, which TF32's rounding alone can exceed, and
    MoE routers that choose the same experts as the reference).
    """
    return [full_name] if full_name == CPU else [(full_name, {"use_tf32": "0"}), CPU]


def available_parity_providers() -> tuple[list[str], dict[str, str]]:
    """Providers to verify on by default, and the skipped ones with the reason."""
    unusable = cuda_unusable()
    if unusable is None:
        return list(PARITY_PROVIDERS), {}
    return [CPU], {CUDA: unusable}
