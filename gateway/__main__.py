"""``python -m gateway`` is the ``gridgate`` command."""

from gateway.cli import main

raise SystemExit(main())
