"""Rollouts: what turns a policy's fleet into episodes, run in the process that drives them.

- ``agent_loop.py``: the single-agent multi-turn loop env jobs use (in the JobDriver's process);
- ``protocol.py``: the ProtocolCoordinator actor, phase-synchronized multi-agent games;
- ``env_io.py``: env calls of a phase, concurrently and under time limits;
- ``text_bridge.py``: a PettingZoo game <-> text, the illegal-move rule.

Both loops sample through a ``RolloutFleet`` (``otray.actors.sampling``), the only folder they import.
"""
