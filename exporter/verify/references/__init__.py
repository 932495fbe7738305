"""The references ONNX Runtime is judged against: the PyTorch model, or a recorded golden bundle."""
