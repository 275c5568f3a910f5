"""A World across nodes, on the launching side: its plan (plan), the scheduler that
starts one agent per node, chosen by name behind one seam (schedulers; slurm_step: one
srun step, ray_step: one placement group with an actor per node; agents: what they
share), the authenticated link to each agent (hub.Hub), the pump that copies each
remote rank's fds to and from its node's link (pump), a call's payload sent to each node
once (payloads) and the group's spawner through the agents (spawner). launch() with one
launcher per node is another mechanism: _engine.tasks."""
