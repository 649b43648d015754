"""What a station runs with, decided before it serves: the settings (`StationConfig`, from flags over `MOONSHINE_*`
variables over defaults), the plan that resolves every `auto` once at start-up, the memory check, start-up timing and
the compilation cache, and the draft model of a station that speculates with one."""
