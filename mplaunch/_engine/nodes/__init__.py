"""The launching side of more than one node. A World across nodes: its agents, one per
node, started as one step of the scheduler (slurm_step: one srun step; ray_step: one
placement group with an actor per node, behind the same calls), the authenticated link
to each (remote.Hub), the pump that copies each remote rank's fds to and from its node's link
(pump), a call's payload sent to each node once (payloads) and the group's spawner
through the agents (spawner). A batch launch across nodes: how the nodes' launchers tell
each other about a failure through the store (sync), and what SLURM's environment says
of a task's place (slurm)."""
