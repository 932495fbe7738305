"""An int4/int8 export made to a quality target: the modules whose rounding costs most are held at more bits until
the artifact keeps the target on held-out text. It both exports (exporter.export) and measures (exporter.verify),
so it sits above both.

- sensitivity: what rounding one module, or a mix of them, costs the float model on text (PyTorch, with the
  verification's statistics);
- search: export_to_target, the mix found, exported, measured and recorded.
"""
