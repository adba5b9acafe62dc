/* placeholder so kvd_core has a source until the memory manager lands. */
int kvmm_placeholder(void);
int kvmm_placeholder(void)
{
    return 0;
}
