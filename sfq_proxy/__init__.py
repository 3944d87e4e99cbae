"""sfq-proxy: a fair-share (Start-time Fair Queueing) front door for shared LLM fleets."""
