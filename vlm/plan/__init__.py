"""`vlm plan`: what one rank of a run needs (memory, communication, checkpoint) and whether it
fits, from the config alone; vlm.plan.plan.make_plan is the entry point, vlm.plan.cli the command."""
