"""Controller-side tools (lab hosts, fleet over SSH). Not used on GPU hosts."""
