"""mixprec under other libraries' APIs: apex.amp (``mixprec.compat.apex_amp``) and
Lightning's precision plugin (``mixprec.lightning``)."""
