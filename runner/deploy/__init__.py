"""Launch files for a job's spot nodes (`grpo-run deploy`), one room each: what a node boots and
installs (node), what each store asks of it (stores), what it may do in its storage (iam), a
Kubernetes Job (kubernetes), a SkyPilot task (skypilot), and the grpo-run wheel the nodes
install, put into the job's storage (wheel). The templates themselves are package data in
deploy/ (grpo_run.deploy)."""
