"""Engine integrations: connectors that let an inference engine move its KV cache through kvxferd.

Each integration talks to the daemons only through :mod:`kvxferd.engine.client`, and
nothing in kvxferd imports an integration (imports point one way).
"""
