/* tenant: tenant and namespace name tables (see tenant.h). Both are small
 * (tens of entries), so lookups are linear scans. */
#include "tenant.h"

#include <stdlib.h>
#include <string.h>

void tenant_table_free(struct tenant_table *tt)
{
    free(tt->v);
    free(tt->ns_names);
    memset(tt, 0, sizeof *tt);
}

uint32_t tenant_find(const struct tenant_table *tt, const char *name)
{
    for (uint32_t i = 0; i < tt->n; i++)
        if (strcmp(tt->v[i].conf.name, name) == 0)
            return i;
    return UINT32_MAX;
}

uint32_t tenant_ns_find(const struct tenant_table *tt, const char *name)
{
    for (uint32_t i = 0; i < tt->n_ns; i++)
        if (strcmp(tt->ns_names[i], name) == 0)
            return i;
    return UINT32_MAX;
}

int tenant_add(struct tenant_table *tt, const struct kvmm_tenant_conf *conf, uint32_t *id)
{
    struct tenant *v = realloc(tt->v, sizeof *v * (tt->n + 1));

    if (!v)
        return KVD_ENOMEM;
    tt->v = v;
    memset(&v[tt->n], 0, sizeof v[tt->n]);
    v[tt->n].conf = *conf;
    v[tt->n].ns = UINT32_MAX;
    *id = tt->n++;
    return 0;
}

int tenant_ns_add(struct tenant_table *tt, const char *name, uint32_t *id)
{
    char(*v)[80] = realloc(tt->ns_names, sizeof *v * (tt->n_ns + 1));

    if (!v)
        return KVD_ENOMEM;
    tt->ns_names = v;
    memset(v[tt->n_ns], 0, sizeof v[tt->n_ns]);
    strncpy(v[tt->n_ns], name, sizeof v[tt->n_ns] - 1);
    *id = tt->n_ns++;
    return 0;
}
