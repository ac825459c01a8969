"""Endpoint health: the probe client, the verdict logic and the health process that publishes verdicts.

probe    the one small HTTP/1.1 GET / TCP connect client (also used by the control plane's observer)
verdict  active-check thresholds and the record composed per endpoint (pure)
writer   the health process: probes, outlier polls, the single writer of health records
"""
