"""Provider conformance (docs/provider-conformance.md, CONTRACT section 22): is a provider fit for its pool?

Pure parts (``sse``, ``checks``, ``targets``, ``report``) take data and return data; ``client`` and
``runner`` do the I/O. ``gridgate providers verify`` (gateway/cli.py) and the supervisor's recheck use
the same checks.
"""
