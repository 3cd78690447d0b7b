"""Memory: what a step may take beyond the optimizer's state, and where state lives.

* :mod:`.budget` — the bytes a wave, an NS call and a run of Nesterov inputs may take;
* :mod:`.lending` — buffers kept across steps whose memory exists only while a step uses them;
* :mod:`.offload` — state held on the host (ZeRO offload), NS on the accelerator.

The bottom stage: imports nothing of the engine.
"""
