"""OpenTelemetry traces of requests (docs/tracing.md): W3C trace context, sampling, spans, OTLP/JSON."""
