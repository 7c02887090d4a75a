"""Plain reference implementations afd is checked against; they import nothing from afd."""
