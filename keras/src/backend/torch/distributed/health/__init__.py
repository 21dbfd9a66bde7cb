"""The job's health: bounded collectives and failures named by process
(`health`); processes that disagree stopped before they hang (`*agreement`)."""
