"""What every process of tollgate reads: the settings (`core.settings`), the data folder's
layout (`core.layout`), the clock (`core.clock`), the schedules of the flows
(`core.schedules`) and the constants shared by the stores and the domain
(`core.constants`). It imports nothing else of tollgate."""
