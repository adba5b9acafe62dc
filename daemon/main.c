/* kvd entry point (placeholder until the server lands). */
#include <stdio.h>
int main(void)
{
    puts("usage: kvd [--help]");
    return 0;
}
