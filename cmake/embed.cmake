# Turns a text file into a C source defining `const char SYMBOL[]` (NUL-terminated).
file(READ ${IN} content HEX)
string(LENGTH "${content}" n)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${content}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" bytes "${bytes}")
file(WRITE ${OUT}.tmp "/* generated from ${IN}: do not edit */\nconst char ${SYMBOL}[] = {\n${bytes}0x00};\n")
file(RENAME ${OUT}.tmp ${OUT})
