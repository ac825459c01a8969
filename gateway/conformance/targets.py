"""Which endpoints to check, for which models, with which promises: from the config and its overlay.

A provider is a cluster; its models are the overlay's ``inference_model`` candidates naming it; what
the pool promises of it (context window, features) is the first ``routing.models`` entry that matches,
as request-aware selection reads it (gateway/routing/eligibility.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

from gateway.config import Cluster, Config, ModelFacts, Tls
from gateway.conformance.probe import Target
from gateway.overlay.snapshot import Snapshot

SURFACES = ("chat", "completions", "embeddings", "responses", "messages")


class TargetError(ValueError):
    """The selection names nothing to check, or a credential is missing; the message names the option."""


def pool_models(snapshot: Snapshot | None, cluster: str) -> list[str]:
    if snapshot is None:
        return []
    names = [c.name for c in snapshot.candidates if c.kind == "inference_model" and c.cluster == cluster]
    return list(dict.fromkeys(names))


def model_facts(entries: Sequence[ModelFacts], model: str, cluster: str) -> ModelFacts | None:
    for entry in entries:
        if (entry.match.cluster is None or entry.match.cluster == cluster) and fnmatchcase(model, entry.match.capability):
            return entry
    return None


def _credential(cluster: Cluster, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    auth = cluster.upstream_auth
    if auth is None:
        return None, None
    secret = environ.get(auth.value_env)
    if not secret:
        raise TargetError(f"clusters[{cluster.name}].upstream_auth.value_env: {auth.value_env} is not set")
    return auth.header.lower(), "Bearer " + secret  # as the workers send it (workers/clusters.py)


def cluster_targets(config: Config, cluster: Cluster, models: Sequence[str], surfaces: Sequence[str],
                    environ: Mapping[str, str]) -> list[Target]:
    header, credential = _credential(cluster, environ)
    tls = Tls() if cluster.tls is True else (cluster.tls or None)
    targets = []
    for model in models:
        facts = model_facts(config.routing.models, model, cluster.name)
        for address, _weight in cluster.weighted_endpoints():
            targets.append(Target(
                cluster.name, address, model,
                context_window=(facts.context_window or 0) if facts else 0,
                features=frozenset(facts.features or ()) if facts else frozenset(),
                surfaces=tuple(surfaces), credential_header=header, credential=credential,
                tls=tls is not None, sni=tls.sni if tls else None,
                ca_file=tls.ca_file if tls else None,  # as the workers load it
                verify=tls.verify if tls else True))
    return targets


def select_targets(config: Config, snapshot: Snapshot | None, *, clusters: Sequence[str] = (),
                   model: str | None = None, surfaces: Sequence[str] = ("chat",),
                   environ: Mapping[str, str]) -> list[Target]:
    """Every endpoint of the chosen clusters (default: all), for the chosen model (default: the pool's)."""
    unknown = [name for name in clusters if config.cluster(name) is None]
    if unknown:
        raise TargetError(f"--cluster: no cluster named {', '.join(map(repr, unknown))} in the config")
    chosen = [c for c in config.clusters if not clusters or c.name in clusters]
    targets = []
    for cluster in chosen:
        served = pool_models(snapshot, cluster.name)
        models = served if model is None else [model] if model in served or not served else []
        targets += cluster_targets(config, cluster, models, surfaces, environ)
    if not targets:
        what = f"model {model!r}" if model else "any model (the overlay names none for these clusters: give --model)"
        raise TargetError(f"--model: no selected cluster serves {what}")
    return targets
