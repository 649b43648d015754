"""The HTTP station: the `Station` (engine, scheduler, readiness), its own routes (`/generate`, `/health`, `/ready`,
`/metrics`), the typed request bodies, settings, access logs, metrics, start-up timing and the draining server."""
