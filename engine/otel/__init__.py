"""OpenTelemetry in and out: runs as OTLP/JSON traces, and traces of LLM programs as runs.

`exporter` writes a run (and its branches) as traces with the GenAI semantic conventions'
`gen_ai.*` attributes and OpenInference's attributes side by side; `otlp` reads OTLP/JSON
files into spans, and `importer` turns the spans that OpenTelemetry's and OpenInference's
instrumentations write for LLM programs into runs (`imported` names what marks such a run,
which no command can re-run). `source` is the one place the exporter reads a run from, and it
reads only what is public.
"""
