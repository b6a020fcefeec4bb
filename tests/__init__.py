"""kvxferd's tests (a package, so ``python -m tests.peers`` runs the integration peers)."""
