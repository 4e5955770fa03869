-- A Prometheus label value: backslash, double quote and newline escaped.
CREATE FUNCTION telemetry_label_escape(value text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT replace(replace(replace(value, '\', '\\'), '"', '\"'), E'\n', '\n')
$$;
