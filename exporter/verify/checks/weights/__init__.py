"""The weight audit: every initializer of both graphs matched to the reference tensor it came from.

Output comparisons cannot see a weight fault smaller than their tolerance: in a float16 export, one channel of a
norm × 1.01 or one weight × 1.05 moves no output beyond float16's own rounding. The weights themselves can be
compared exactly, without running anything.

- audit: audit_weights, each graph's initializers held to the reference's tensors by content and in their place;
- tensors: the reference's tensors in every form an initializer may hold them, and the initializers' values read
  from the artifact;
- quantized: the blocks of a quantized artifact's MatMulNBits and GatherBlockQuantized nodes, their scheme and the
  embedding's row ids;
- results: the findings and the audits of each graph and of both, as the reports read them.
"""
