"""Before the hardware is booked: compile the step for a target, read its memory, FLOPs, traffic and collectives, and find what makes it fit."""
