"""``kvferry bench …``: benchmarks that write JSON and a table, and the harnesses they drive (a sidecar in its own
process, a real redis-server, vLLM engines). Nothing in the product packages imports this."""
