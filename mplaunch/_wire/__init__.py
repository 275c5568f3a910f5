"""What crosses a process boundary: the messages (messages), their framing (channel),
what a rank is started from (spec), payloads and results (payload, mainmod), exceptions
and stacks as they travel (exceptions, stacks), and the Linux primitives every process
uses (linux). Imports nothing else of mplaunch but its public errors."""
