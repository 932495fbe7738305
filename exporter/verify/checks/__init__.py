"""The checks that compare ONNX Runtime with a reference, or with itself."""
