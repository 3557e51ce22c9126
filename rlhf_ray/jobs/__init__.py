"""Job drivers: the control loop of each job kind, readable as pseudocode."""
