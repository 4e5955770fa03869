"""Pure executor logic: placement lifecycle, failure classification, allow-list policy, fencing. No I/O here."""
