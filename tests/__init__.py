"""kvxferd's tests (a package, so ``python -m tests.support.peers`` runs the integration peers)."""
