"""``gridgate`` command line (docs/operations.md#commands-and-exit-codes).

Exit codes: 0 success, 1 invalid input or config (the message names the field),
2 usage error (argparse's own code). Expected failures print one line per problem
on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from gateway.config import Config, ConfigError, load_config
from gateway.net import parse_host_port

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_NONCONFORMANT = 3  # providers verify: a required check failed


class CommandError(Exception):
    """An expected failure: each line of ``problems`` goes to stderr, then exit 1."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# ---------------------------------------------------------------- argument types


def _worker_count(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid worker count {text!r}: 'auto' or an integer >= 1")


def _listen_address(text: str) -> str:
    try:
        parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# ---------------------------------------------------------------- sub-commands


def _load_config(path: str) -> Config:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise CommandError(*exc.problems) from None


def cmd_check(args: argparse.Namespace) -> int:
    from gateway.check import check_problems

    problems = check_problems(_load_config(args.config), environ=None if args.no_env else os.environ)
    if problems:
        raise CommandError(*problems)
    print("ok")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from gateway.supervisor import RunOverrides, StartupError
    from gateway.supervisor.arbiter import Arbiter

    overrides = RunOverrides(workers=args.workers, listen=args.listen)
    config = overrides.apply(_load_config(args.config))
    try:
        return Arbiter(args.config, config, overrides).run()
    except StartupError as exc:
        raise CommandError(str(exc)) from None


def cmd_control(args: argparse.Namespace) -> int:
    from gateway.control.runner import control_main

    return control_main(args.config)


def cmd_overlay_digest(args: argparse.Namespace) -> int:
    from gateway.overlay.contract import OverlayRejected, parse_json
    from gateway.overlay.digest import semantic_revision

    try:
        with open(args.file, "rb") as handle:
            document = parse_json(handle.read())
    except OSError as exc:
        raise CommandError(f"{args.file}: cannot read: {exc.strerror}") from None
    except OverlayRejected as exc:
        raise CommandError(f"{args.file}: {exc}") from None
    # An envelope carries the overlay document under "overlay"; a legacy file is the document.
    if isinstance(document, dict) and isinstance(document.get("overlay"), dict):
        document = document["overlay"]
    if not isinstance(document, dict):
        raise CommandError(f"{args.file}: malformed_structure: the overlay must be a JSON object")
    try:
        print(semantic_revision(document))
    except ValueError as exc:  # rfc8785 refuses values without a canonical form
        raise CommandError(f"{args.file}: malformed_structure: {exc}") from None
    return EXIT_OK


def cmd_overlay_validate(args: argparse.Namespace) -> int:
    from gateway.overlay.contract import OverlayRejected
    from gateway.overlay.watch import load_overlay_file

    scope = _load_config(args.config).routing.expected_overlay_scope if args.config else None
    try:
        load_overlay_file(args.file, scope)
    except OverlayRejected as exc:
        raise CommandError(str(exc)) from None  # "reason: detail", the reason first for scripts
    print("ok")
    return EXIT_OK


def cmd_keys_hash(args: argparse.Namespace) -> int:
    from gateway.identity.auth import hash_api_key

    key = sys.stdin.read()
    if not key.strip():
        raise CommandError("keys hash: no API key on stdin")
    print(hash_api_key(key))
    return EXIT_OK


def _admin_client(args: argparse.Namespace):  # -> gateway.keys.admin_client.AdminClient
    from gateway.keys.admin_client import DEFAULT_ADMIN, TOKEN_ENV, AdminClient, connect_address

    listen = args.admin or (_load_config(args.config).admin.listen if args.config else DEFAULT_ADMIN)
    try:
        address = connect_address(listen)
    except ValueError as exc:
        raise CommandError(f"--admin: {exc}") from None
    return AdminClient(address, os.environ.get(TOKEN_ENV) or None)


def cmd_keys_admin(args: argparse.Namespace) -> int:
    """keys create | list | show | block | unblock | revoke | rotate: one admin API call each."""
    from gateway.keys import admin_client as show
    from gateway.keys.admin_client import AdminCallFailed

    client = _admin_client(args)
    action = args.keys_command
    try:
        if action == "create":
            if any("=" not in pair for pair in args.metadata):
                raise CommandError("--metadata: give KEY=VALUE")
            answer = client.call("POST", "/admin/keys", show.create_body(
                args.tenant, args.alias, args.models, args.rpm, args.expires, args.metadata))
            text = show.with_key(answer)
        elif action == "list":
            answer, text = _list_keys(client, args)
        elif action == "show":
            answer = client.call("GET", show.kid_path(args.kid))
            text = show.record_lines(answer)
        elif action == "rotate":
            answer = client.call("POST", show.kid_path(args.kid, "rotate"), {"grace": args.grace})
            text = show.with_key(answer)
        else:  # block | unblock | revoke
            answer = client.call("POST", show.kid_path(args.kid, action))
            text = show.record_lines(answer)
    except AdminCallFailed as exc:
        raise CommandError(f"keys {action}: {exc}") from None
    print(json.dumps(answer, indent=2) if args.json else text)
    return EXIT_OK


def _list_keys(client, args: argparse.Namespace) -> tuple[dict, str]:
    """Follows the API's cursor until ``--limit`` records or the end."""
    from gateway.keys.admin_client import table

    rows: list[dict] = []
    cursor = args.cursor
    while len(rows) < args.limit:
        page = client.call("GET", "/admin/keys", query={
            "tenant": args.tenant, "alias": args.alias, "status": args.status, "cursor": cursor,
            "limit": str(min(1000, args.limit - len(rows)))})
        rows += page["data"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    if cursor is not None and not args.json:
        print(f"(more keys: continue with --cursor {cursor})", file=sys.stderr)
    return {"object": "list", "data": rows, "next_cursor": cursor}, table(rows)


def cmd_spend(args: argparse.Namespace) -> int:
    """spend: the admin API's spend report (``GET /admin/spend``) as a table, or its JSON."""
    from gateway.keys.admin_client import AdminCallFailed
    from gateway.spend.report import spend_table

    client = _admin_client(args)
    try:
        answer = client.call("GET", "/admin/spend", query={
            "tenant": args.tenant, "kid": args.kid, "model": args.model, "from": args.from_day, "to": args.to_day,
            "group_by": args.group_by})
    except AdminCallFailed as exc:
        raise CommandError(f"spend: {exc}") from None
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(f"spend {answer['from']} .. {answer['to']} (UTC days), by {answer['group_by']}")
        print(spend_table(answer))
    return EXIT_OK


def cmd_providers_verify(args: argparse.Namespace) -> int:
    """providers verify: the conformance checks against each selected provider endpoint."""
    import asyncio

    from gateway.check import load_overlay_snapshot
    from gateway.conformance import report
    from gateway.conformance.runner import verify
    from gateway.conformance.targets import TargetError, select_targets

    config = _load_config(args.config)
    try:
        targets = select_targets(config, load_overlay_snapshot(config), clusters=args.cluster, model=args.model,
                                 surfaces=args.surface or ["chat"], environ=os.environ)
    except (TargetError, ConfigError) as exc:
        raise CommandError(*getattr(exc, "problems", [str(exc)])) from None
    reports = asyncio.run(verify(targets, max_tokens=args.max_tokens, timeout_s=args.timeout))
    document = report.as_json(reports)
    text = report.table(reports)
    shares_kept = True
    if args.load is not None:
        load_json, load_text = _verify_load(args, config, load_overlay_snapshot(config), targets)
        document["load"], text = load_json, text + "\n" + load_text
        shares_kept = all(phase["share_verdict"] != "fail" for phase in load_json)
    print(json.dumps(document, indent=2) if args.json else text)
    return EXIT_OK if report.all_conformant(reports) and shares_kept else EXIT_NONCONFORMANT


def _verify_load(args: argparse.Namespace, config: Config, snapshot: Any, targets: list) -> tuple[list[dict], str]:
    """--load: a child gateway, half the time with every provider of the model, half with one down; each
    phase's shares against what the picker promises."""
    import asyncio

    from gateway.conformance.load import load_table, plot, run_load
    from gateway.conformance.promise import promise

    model = args.model or targets[0].model
    providers = list(dict.fromkeys(t.cluster for t in targets if t.model == model))
    if len(providers) < 2:
        raise CommandError(f"--load: model {model!r} has {len(providers)} provider(s) here; it needs two or more")
    phases = asyncio.run(run_load(args.config, model, providers, args.load, args.max_tokens,
                                  lambda usable: promise(snapshot, config.routing, model, usable),
                                  args.share_tolerance))
    text = load_table(phases)
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        path = os.path.join(args.report, "load.png")
        plot(phases, path)
        with open(os.path.join(args.report, "load.json"), "w") as handle:
            json.dump([p.as_dict() for p in phases], handle, indent=2)
        text += f"\nplot: {path}"
    return [p.as_dict() for p in phases], text


# ---------------------------------------------------------------- parser


def package_version() -> str:
    try:
        return metadata.version("gridgate")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _command(commands: argparse._SubParsersAction, name: str, summary: str, details: str = "") -> argparse.ArgumentParser:
    """A sub-command whose ``-h`` starts with the summary shown in its parent's list."""
    description = f"{summary[0].upper()}{summary[1:]}." + (f" {details}" if details else "")
    return commands.add_parser(name, help=summary, description=description)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gridgate",
        description="High-throughput gateway between LLM clients and equivalent LLM provider gateways.",
        epilog="Exit codes: 0 success, 1 invalid input or config (the message names the field), 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"gridgate {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = _command(commands, "run", "run the supervisor and its workers in the foreground",
                   "Runs until SIGTERM/SIGINT; SIGHUP reloads the config and the overlay, SIGTTIN/SIGTTOU add or "
                   "remove a worker. --workers and --listen win over the file, also on every reload.")
    run.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML config file")
    run.add_argument("--workers", type=_worker_count, metavar="N", help="worker processes ('auto' = one per CPU)")
    run.add_argument("--listen", type=_listen_address, metavar="HOST:PORT", help="data-plane address")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.set_defaults(handler=cmd_run)

    check = _command(commands, "check", "validate the config and the overlay it names",
                     "Prints ok and exits 0, or prints one line per problem on stderr, each naming the field, "
                     "and exits 1.")
    check.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML config file")
    check.add_argument("--no-env", action="store_true",
                       help="do not require the upstream_auth.value_env secrets to be set (for CI)")
    check.set_defaults(handler=cmd_check)

    overlay = _command(commands, "overlay", "inspect routing overlay files")
    overlay_commands = overlay.add_subparsers(dest="overlay_command", metavar="ACTION", required=True)
    digest = _command(overlay_commands, "digest", "print the 64-hex semantic revision of an overlay",
                      "The SHA-256 of the RFC 8785 canonical form of the overlay document's candidates, "
                      "local_site, network and selection_policy; envelopes and legacy files alike.")
    digest.add_argument("file", metavar="FILE")
    digest.set_defaults(handler=cmd_overlay_digest)
    validate = _command(overlay_commands, "validate", "exit 0 if the overlay is acceptable, else 1",
                        "On rejection, stderr starts with the reason (digest_mismatch, scope_mismatch, ...).")
    validate.add_argument("file", metavar="FILE")
    validate.add_argument(
        "-c", "--config", metavar="FILE", help="also enforce this config's routing.expected_overlay_scope"
    )
    validate.set_defaults(handler=cmd_overlay_validate)

    control = _command(commands, "control", "run the control plane: observe providers, publish routing overlays",
                       "Runs until SIGTERM/SIGINT; publishes only when the semantic revision changes.")
    control.add_argument("-c", "--config", required=True, metavar="FILE", help="control-plane spec file")
    control.set_defaults(handler=cmd_control)

    keys = _command(commands, "keys", "API key helpers")
    keys_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    hash_ = _command(keys_commands, "hash", "read an API key on stdin, print its sha256: form",
                     "Paste the output into auth.keys[].key; the key itself never goes into the config.")
    hash_.set_defaults(handler=cmd_keys_hash)
    _keys_admin_commands(keys_commands)

    spend = _command(commands, "spend", "print what was spent, from the daily rollups",
                     "Reads the admin API's GET /admin/spend (scope spend:read; the token from "
                     "GRIDGATE_ADMIN_TOKEN) and prints one line per day, model, key or tenant, the totals last.")
    spend.add_argument("-c", "--config", metavar="FILE", help="gateway config: the admin API is its admin.listen")
    spend.add_argument("--admin", metavar="HOST:PORT", help="the admin API's address (default: from -c, else "
                       "127.0.0.1:9901)")
    spend.add_argument("--tenant", help="only this tenant")
    spend.add_argument("--kid", help="only this key: a kid, a YAML key's alias, or - (no key)")
    spend.add_argument("--model", help="only this served model")
    spend.add_argument("--from", dest="from_day", metavar="YYYY-MM-DD", help="first UTC day (default: 29 days "
                       "before --to)")
    spend.add_argument("--to", dest="to_day", metavar="YYYY-MM-DD", help="last UTC day (default: today)")
    spend.add_argument("--group-by", default="day", choices=["day", "model", "key", "tenant", "subject"])
    spend.add_argument("--json", action="store_true", help="print the API's JSON answer (for scripts)")
    spend.set_defaults(handler=cmd_spend)
    _providers_commands(commands)
    return parser


def _providers_commands(commands: argparse._SubParsersAction) -> None:
    from gateway.conformance.targets import SURFACES

    providers = _command(commands, "providers", "provider helpers")
    actions = providers.add_subparsers(dest="providers_command", metavar="ACTION", required=True)
    verify = _command(actions, "verify", "check that each provider endpoint is fit for its pool",
                      "Runs the conformance checks (docs/provider-conformance.md) against every endpoint of the "
                      "selected clusters, with TLS, SNI and the upstream credential as the config sets them. "
                      "Exit 0 when every required check passed, 3 when one failed, 1 for a bad config.")
    verify.add_argument("-c", "--config", required=True, metavar="FILE", help="gateway config file")
    verify.add_argument("--cluster", action="append", default=[], metavar="NAME",
                        help="only this cluster (repeatable; default: every cluster)")
    verify.add_argument("--model", help="check this model (default: each model the overlay gives the cluster)")
    verify.add_argument("--surface", action="append", choices=SURFACES, metavar="API",
                        help=f"an API the pool serves (repeatable: {', '.join(SURFACES)}; default: chat)")
    verify.add_argument("--max-tokens", type=_positive, default=16, metavar="N",
                        help="output tokens each request asks for at most (default 16)")
    verify.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                        help="deadline of each check, all its requests together (default 30)")
    verify.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    verify.add_argument("--load", type=_duration, metavar="DURATION",
                        help="also run a short load (e.g. 30s) through a child gateway, one provider forced down "
                        "half way")
    verify.add_argument("--report", metavar="DIR", help="with --load: write load.png and load.json here")
    verify.add_argument("--share-tolerance", type=_fraction, default=0.05, metavar="FRACTION",
                        help="with --load: how far a provider's share may be from the picker's promise, plus "
                        "sampling error (default 0.05)")
    verify.set_defaults(handler=cmd_providers_verify)


def _duration(text: str) -> float:
    from gateway.yaml_config import parse_duration

    try:
        seconds = float(parse_duration(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: 1s..1h")
    return seconds


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: 0..1")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: an integer >= 1")
    return int(text)


def _keys_admin_commands(keys_commands: argparse._SubParsersAction) -> None:
    """The managed-key sub-commands: each is one call to the admin API (docs/keys.md)."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("-c", "--config", metavar="FILE", help="gateway config: the admin API is its admin.listen")
    where.add_argument("--admin", metavar="HOST:PORT", help="the admin API's address (default: from -c, else "
                       "127.0.0.1:9901)")
    where.add_argument("--json", action="store_true", help="print the API's JSON answer (for scripts)")
    epilog = "The admin token is read from GRIDGATE_ADMIN_TOKEN."

    def command(name: str, summary: str, details: str = "") -> argparse.ArgumentParser:
        sub = keys_commands.add_parser(name, help=summary, parents=[where], epilog=epilog,
                                       description=f"{summary[0].upper()}{summary[1:]}." + (f" {details}" if details else ""))
        sub.set_defaults(handler=cmd_keys_admin)
        return sub

    create = command("create", "create a managed key; prints it once",
                     "The key is shown this one time; the gateway keeps only its SHA-256 digest.")
    create.add_argument("--tenant", required=True, help="tenant the key belongs to ([A-Za-z0-9._-]{1,64})")
    create.add_argument("--alias", help="a name for the key (quota rules may match it)")
    create.add_argument("--models", nargs="+", metavar="GLOB", help="models the key may use (default: the tenant's)")
    create.add_argument("--rpm", type=_positive, metavar="N", help="requests per minute for this key")
    create.add_argument("--expires", metavar="DURATION|TIME", help="30d from now, or an RFC 3339 time")
    create.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    listing = command("list", "list managed keys (never secrets)")
    listing.add_argument("--tenant")
    listing.add_argument("--alias")
    listing.add_argument("--status", choices=["active", "blocked", "revoked"])
    listing.add_argument("--limit", type=_positive, default=100, metavar="N", help="at most N keys (default 100)")
    listing.add_argument("--cursor", help="continue after this kid (printed when more keys remain)")
    show = command("show", "show one key's record")
    show.add_argument("kid", metavar="KID")
    for name, summary in (("block", "block a key: refused until unblocked"), ("unblock", "unblock a blocked key"),
                          ("revoke", "revoke a key for good")):
        command(name, summary, "Every gateway sharing the store refuses it within a second.").add_argument(
            "kid", metavar="KID")
    rotate = command("rotate", "give a key a new secret; prints it once",
                     "Same kid, limits and counters; the old secret keeps working for --grace.")
    rotate.add_argument("kid", metavar="KID")
    rotate.add_argument("--grace", default="0s", metavar="DURATION",
                        help="how long the old secret keeps working (e.g. 24h; default 0s: it stops now)")


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(getattr(args, "log_level", "warning"))
    try:
        return args.handler(args)
    except CommandError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
