"""The agent: one ``ckptrun`` process per machine, supervising that machine's workers.

* :mod:`~ckptrun.agent.supervisor` -- the supervision loop (``run_agent``): start, watch,
  stop, restart, restore; ``status.json``;
* :mod:`~ckptrun.agent.rendezvous` -- torch's rendezvous handler, the job-wide epoch and
  restart budget, the agreements between machines, the workers' torchrun environment;
* :mod:`~ckptrun.agent.membership` -- liveness of the other machines, stable ranks across a
  re-rendezvous, the tiers built for each membership;
* :mod:`~ckptrun.agent.workers` -- starting a worker group, warm spares, retiring a group;
* :mod:`~ckptrun.agent.stopping` -- killing process trees, what ``/proc`` says of an exit;
* :mod:`~ckptrun.agent.logs` -- where worker output goes;
* :mod:`~ckptrun.agent.hang` -- hang detection from heartbeats, stack dumps;
* :mod:`~ckptrun.agent.reaper` -- the watchdog that kills the workers if the agent dies;
* :mod:`~ckptrun.agent.events` -- ``events.jsonl``, the stderr echo, run-dir JSON files.

The agent may import the tiers, the store access, the protocol and the snapshot format; it
never imports the worker side (the workers are other processes, reached through the
protocol) or the command line.
"""
