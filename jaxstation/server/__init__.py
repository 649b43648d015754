"""The HTTP station: the `Station` (engine, scheduler, adapters, readiness), its own routes (`/generate`, `/health`,
`/ready`, `/metrics`), the typed request bodies and error shapes shared by every API, /openapi.json, access logs, the
chat page (`web/`) and the draining uvicorn server."""
