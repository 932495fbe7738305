"""The KV cache of CPU decode steps, in buffers that stay bound from one step to the next.

Driven the plain way, every decode step binds the past values, binds each output for
onnxruntime to allocate anew and picks the presents out of the results: about 55 calls
into onnxruntime's binding a step, each slow on the caches that streaming the weights
has just emptied. Here each layer's past and present are views into two buffers with
spare slots, bound once:

- past (B, Hkv, capacity, D): the cached positions, then unfilled slots that the
  attention mask zeroes out;
- present (B, Hkv, capacity + n, D), into which the graph's concat writes the past and
  the n new positions.

After the run the new positions are copied from present into past, one numpy copy for
all layers, and the binding stays as it is: a step is a few numpy writes and one run.
With a bare greedy loop around it, minimind-3 spends 0.31 ms a step outside the run
against 0.48 ms the plain way (medians of 15 generations each, in turns). When the spare
slots run out, both buffers grow by SPARE_SLOTS and are bound again.

The graph is decode.onnx as exported. A masked slot adds exactly zero to its query's
softmax and weighted sum, so the logits equal the plain step's up to float rounding
(the order of the sums), and greedy tokens are the same (tested).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from exporter.contract import CacheLayout

# Spare slots per growth. Each step's concat copies the spare slots too (minimind-3: 24.6 KB a
# slot); a growth copies the cache once and binds ~40 values. 32 keeps both near 0.05 ms a step.
SPARE_SLOTS = 32


class StepCache:
    """Decode steps on the CPU over fixed, bound buffers; made from the cache a prompt left.

    `values` are onnxruntime C OrtValues (B, Hkv, L, D), in the order of `past_names`;
    `present_names[i]` is the output that becomes `past_names[i]`.
    """

    def __init__(self, session: ort.InferenceSession, layout: CacheLayout, vocab_size: int,
                 past_names: list[str], present_names: list[str], values: list):
        self._session = session
        self._binding = session.io_binding()._iobinding
        self._run = session._sess.run_with_iobinding
        self._past_names, self._present_names = past_names, present_names
        self._dtype = np.dtype(layout.dtype)
        self._vocab_size = vocab_size
        self.batch, heads, self.length, head_dim = values[0].shape()
        self._slot = (heads, head_dim)
        self._grow([value.numpy() for value in values], new=1)

    def _allocate(self, shape: tuple, dtype) -> np.ndarray:
        """Memory from the session's arena, where the plain steps' caches came from: the chunks
        they freed are reused rather than adding to the RSS."""
        return self._session.create_ortvalue_from_shape_and_type(list(shape), dtype, "cpu").numpy()

    def _grow(self, layers, new: int) -> None:
        """A past with SPARE_SLOTS more slots than a step of `new` tokens needs, holding `layers`' cached
        positions, and the buffers of such steps."""
        self.capacity = self.length + new + SPARE_SLOTS
        past = self._allocate((len(self._past_names), self.batch, self._slot[0], self.capacity, self._slot[1]),
                              self._dtype)
        for layer, cached in zip(past, layers):
            layer[:, :, :self.length] = cached[:, :, :self.length]
        # Masked slots weigh zero, but the arena's leftovers may be NaN, and 0 * NaN is NaN.
        past[:, :, :, self.length:] = 0
        self._past = past
        for name, layer in zip(self._past_names, past):
            self._binding.bind_ortvalue_input(name, _value(layer))
        self._bind_new(new)

    def _bind_new(self, new: int) -> None:
        """Buffers for steps of `new` tokens: present, the mask, the token inputs and the logits."""
        self.new = new
        self._present = self._allocate((len(self._past_names), self.batch, self._slot[0], self.capacity + new,
                                        self._slot[1]), self._dtype)
        for name, layer in zip(self._present_names, self._present):
            self._binding.bind_ortvalue_output(name, _value(layer))
        self._mask = np.zeros((self.batch, self.capacity + new), dtype=np.int64)
        self._input_ids = np.zeros((self.batch, new), dtype=np.int64)
        self._position_ids = np.zeros((self.batch, new), dtype=np.int64)
        for name, array in (("attention_mask", self._mask), ("input_ids", self._input_ids),
                            ("position_ids", self._position_ids)):
            self._binding.bind_ortvalue_input(name, _value(array))
        self._logits = self._allocate((self.batch, new, self._vocab_size), self._dtype)
        self._binding.bind_ortvalue_output("logits", _value(self._logits))

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """One decode.onnx run on the cache; the inputs as OrtRunner.step takes them (checked there)."""
        new, length = input_ids.shape[1], self.length
        if length + new > self.capacity:
            self._grow(self._past, new)
        elif new != self.new:
            self._bind_new(new)
        capacity = self.capacity
        self._input_ids[...] = input_ids
        self._position_ids[...] = position_ids
        self._mask[:, :length] = attention_mask[:, :length]
        self._mask[:, capacity:] = attention_mask[:, length:]
        self._run(self._binding, None)
        self._past[:, :, :, length:length + new] = self._present[:, :, :, capacity:]
        self.length = length + new
        return self._logits[:, -1].astype(np.float32)


def _value(array: np.ndarray):
    """A C OrtValue over `array`'s memory (CPU: no copy), for the binding."""
    return ort.OrtValue.ortvalue_from_numpy(array)._ortvalue
