/* protocol codec (placeholder until the codec lands). */
int kvd_proto_placeholder(void);
int kvd_proto_placeholder(void)
{
    return 0;
}
