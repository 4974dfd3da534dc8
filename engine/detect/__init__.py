"""The sabotage detector: which agent sabotaged the run? Reads the public view only.

`analyze(journal, run_id, method=...)` returns the blog's output format; see
engine/detect/analysis.py for the methods and engine/detect/evaluate.py for `detect-eval`.
"""

from engine.detect.analysis import METHODS, DetectError, analyze

__all__ = ["METHODS", "DetectError", "analyze"]
