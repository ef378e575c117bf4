"""Who watches the job: one fold of the event stream (observer) and the tools built on it: status,
replay/export, the dashboard."""
