"""The HTTP station: the `Station` (engine, scheduler, readiness), its own routes (`/generate`, `/health`, `/ready`,
`/metrics`), the typed request bodies, /openapi.json, settings, access logs, start-up timing and the draining server."""
