"""decode.onnx's session for generation, through onnxruntime's Python binding with IO binding: the KV cache is the
binding's OrtValues, bound from one step to the next (on CUDA never leaving the device)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from exporter.artifact.contract import CacheLayout


class BindingDecode:
    """decode.onnx's session, for OrtRunner's start/step; the cache is a list of the binding's C OrtValues, in the
    order of `past_names`.

    Args:
        session: the session on decode.onnx.
        past_names: decode.onnx's past inputs, in the order the cache lists them.
        output_names: decode.onnx's outputs: "logits" and the presents, the presents in the order of
            `past_names` (the i-th present is the next step's i-th past).
        cache: the manifest's cache layout (heads, head size, dtype) an empty cache is made with.
        cache_device: "cpu" or "cuda": where the presents are allocated and the cache stays between steps.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        past_names: list[str],
        output_names: list[str],
        cache: CacheLayout,
        cache_device: str,
    ):
        self.session = session
        self._past_names, self._cache_device = past_names, cache_device
        self._empty_shape = (cache.num_key_value_heads, 0, cache.head_dim)
        self._dtype = np.dtype(cache.dtype)
        # Per step: one binding reused rather than rebuilt, each output's role looked up once rather than its cache
        # names formatted again, and the binding's C object driven directly: onnxruntime's Python wrappers check
        # every value and build a device object per call, which a step on a small model notices.
        self._binding = session.io_binding()._iobinding
        self._run_binding = session._sess.run_with_iobinding
        self._logits_index = output_names.index("logits")
        self._present_indices = [i for i, name in enumerate(output_names) if name != "logits"]
        # Every output is bound afresh each step: the previous presents are the cache bound as
        # inputs, and onnxruntime must allocate new ones rather than write into them.
        self._output_devices = [
            (name, ort.OrtDevice.make("cpu" if name == "logits" else cache_device, 0)._get_c_device())
            for name in output_names
        ]

    def run(self, output_names: list[str], feeds: dict) -> list:
        return self.session.run(output_names, feeds)

    @staticmethod
    def cache_shape(cache: list) -> tuple[int, int]:
        shape = cache[0].shape()
        return shape[0], shape[2]

    @staticmethod
    def cache_arrays(cache: list) -> list[np.ndarray]:
        return [value.numpy() for value in cache]

    def empty_cache(self, batch: int) -> list:
        # Allocated by onnxruntime on the cache's device, so that each C value owns its (empty) memory.
        shape = (batch, *self._empty_shape)
        return [
            ort.OrtValue.ortvalue_from_shape_and_type(shape, self._dtype, self._cache_device)._ortvalue
            for _ in self._past_names
        ]

    def step(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, cache: list
    ) -> tuple[np.ndarray, list]:
        """Run new tokens on `cache`; the arrays must stay alive until the run returns: the binding reads them
        in place.

        Args:
            input_ids: the new tokens, (batch, tokens) int64.
            attention_mask: (batch, cached + tokens) int64: 1 for a token, 0 for left padding.
            position_ids: the new tokens' positions, (batch, tokens) int64.
            cache: the past, as empty_cache or a previous step returned it.

        Returns:
            The last position's logits, (batch, vocab) float32, and the new cache.
        """
        binding = self._binding
        for name, value in (
            ("input_ids", input_ids),
            ("attention_mask", attention_mask),
            ("position_ids", position_ids),
        ):
            binding.bind_input(name, value)
        for name, value in zip(self._past_names, cache):
            binding.bind_ortvalue_input(name, value)
        for name, device in self._output_devices:
            binding.bind_output(name, device)
        self._run_binding(binding, None)
        outputs = binding.get_outputs()
        new = [outputs[i] for i in self._present_indices]
        logits = outputs[self._logits_index].numpy()
        # A decode step's logits are returned as they are; of a prompt chunk's, the last position is
        # copied so that the others are freed rather than kept alive by a view.
        return logits[:, -1].astype(np.float32, copy=logits.shape[1] > 1), new
