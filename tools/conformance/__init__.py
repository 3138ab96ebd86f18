"""The conformance suite: the engine's kernel calls through the real Python of each supported release.

A case is a pytest function that fetches a release (``sources.fetch(dist, version)``) and runs a
function of its own module in a fresh interpreter (``isolate.run("tools.conformance.<module>:<function>",
*string_args)``), since several releases of one package cannot share a process. That function puts the
release on ``sys.path`` (with stand-ins for its compiled parts, ``standins.py``), asks the dispatcher
for its decision with the backend named (``engine.decision(backend_id, q, k, v, mask, sm=...)``), runs
``decision.run(q, k, v, mask, scale)`` and checks the result (``engine.check``: float64 reference and
fp32 SDPA, bound by dtype). It fails by raising; its output is shown when it does.
"""
