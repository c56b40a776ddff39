"""Serving: the bundle a model is exported to, the scoring model, the `Predictor` that scores raw
lines, the export folder a stream writes, and (``mpips.serve``) the network server over them.

``mpips.serving.Predictor`` is the public name (kept from when this was one module)."""
from mpips.serving.predictor import LineError, Predictor, line_parser, parse_lines

__all__ = ["LineError", "Predictor", "line_parser", "parse_lines"]
