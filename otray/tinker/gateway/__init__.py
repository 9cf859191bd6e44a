"""The Tinker API's HTTP ingress: the ``TinkerGateway`` and ``TinkerOpenAI`` Serve deployments and the
caller lookup they share. Each body is checked at the route and handed to the TinkerService actor.

Runs in the gateway's Ray Serve replicas.
"""
